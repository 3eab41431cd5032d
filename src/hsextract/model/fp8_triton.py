"""The Triton kernels behind fp8_kernels.py (imported only when one runs: it needs Triton)."""

import triton
import triton.language as tl


@triton.jit
def quantize_groups(y, S, row, M, g, mask_g):
    # y: [n_groups, 128] float32 of one row, its groups g (indices): the scales stored at S[g, row] ([G, M]
    # row-major: the outer-dim-major layout), the values returned clamped for the cast (amax / (amax / 448)
    # can round a hair above 448).
    scale = tl.max(tl.abs(y), axis=1) / 448.0
    div = tl.where(scale > 0, scale, 1.0)
    tl.store(S + g.to(tl.int64) * M + row, scale, mask=mask_g)
    return tl.clamp(y / div[:, None], -448.0, 448.0)


@triton.jit
def row_groups(K, NG: tl.constexpr):
    # A program of a (row, group block) grid over [M, K]: its row, its NG groups of 128 columns, their columns and
    # the columns' mask.
    row = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1) * NG + tl.arange(0, NG)
    c = gi[:, None] * 128 + tl.arange(0, 128)[None, :]
    return row, gi, c, c < K


@triton.jit
def quantize_rows(X, Q, S, M, K, sx, NG: tl.constexpr):
    row, gi, c, m = row_groups(K, NG)
    y = tl.load(X + row * sx + c, mask=m, other=0.0).to(tl.float32)
    q = quantize_groups(y, S, row, M, gi, gi * 128 < K)
    tl.store(Q + row * K + c, q.to(Q.dtype.element_ty), mask=m)


@triton.jit
def rms_norm_quant(
    X, R, W, Q, S, SUM, NORMED, M, K, sx, sr, eps,
    HAS_RES: tl.constexpr, HAS_NORMED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < K
    x = tl.load(X + row * sx + c, mask=m, other=0.0)
    if HAS_RES:
        s = (x.to(tl.float32) + tl.load(R + row * sr + c, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(SUM + row * K + c, s, mask=m)
        x = s
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
    y = xf * rstd * (1.0 + tl.load(W + c, mask=m, other=0.0).to(tl.float32))
    if HAS_NORMED:
        tl.store(NORMED + row * K + c, y.to(NORMED.dtype.element_ty), mask=m)
    NG: tl.constexpr = BLOCK // 128
    gi = tl.arange(0, NG)
    q = quantize_groups(tl.reshape(y, (NG, 128)), S, row, M, gi, gi * 128 < K)
    c2 = gi[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(Q + row * K + c2, q.to(Q.dtype.element_ty), mask=c2 < K)


@triton.jit
def silu_mul_quant(GU, Q, S, M, N, sgu, NG: tl.constexpr):
    row, gi, c, m = row_groups(N, NG)
    g = tl.load(GU + row * sgu + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + row * sgu + N + c, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    q = quantize_groups(y, S, row, M, gi, gi * 128 < N)
    tl.store(Q + row * N + c, q.to(Q.dtype.element_ty), mask=m)


@triton.jit
def head_quant(
    A, G, W, Q, S, M, n_vec, T, H, sab, sat, sah, sgb, sgt, sgh, eps,
    D: tl.constexpr, GATED_NORM: tl.constexpr, VB: tl.constexpr,
):  # fmt: skip
    # One program: VB head vectors v = (b * T + t) * H + h of D (a multiple of 128) of [B, T, H, D] inputs, written
    # to row b * T + t, columns h * D... GATED_NORM: w * a / rms(a) * silu(g), the norm rounded to the activation
    # dtype before the weight as stock (the Gated-DeltaNet's output norm); else a * sigmoid(g) (the attention's gate).
    v = tl.program_id(0).to(tl.int64) * VB + tl.arange(0, VB)
    mv = v < n_vec
    row = v // H
    h = v % H
    b = row // T
    t = row % T
    d = tl.arange(0, D)
    a = tl.load(A + (b * sab + t * sat + h * sah)[:, None] + d[None, :], mask=mv[:, None], other=0.0)
    g = tl.load(G + (b * sgb + t * sgt + h * sgh)[:, None] + d[None, :], mask=mv[:, None], other=0.0)
    af = a.to(tl.float32)
    gf = g.to(tl.float32)
    if GATED_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(af * af, axis=1) / D + eps)
        n = (af * rstd[:, None]).to(a.dtype).to(tl.float32)
        y = tl.load(W + d).to(tl.float32)[None, :] * n * (gf * tl.sigmoid(gf))
    else:
        y = af * tl.sigmoid(gf)
    NG: tl.constexpr = D // 128
    gi = tl.arange(0, NG)
    groups = tl.reshape((h * NG)[:, None] + gi[None, :], (VB * NG,))
    rows = tl.reshape(row[:, None] + 0 * gi[None, :], (VB * NG,))
    valid = tl.reshape(mv[:, None] & (gi[None, :] < NG), (VB * NG,))
    q = quantize_groups(tl.reshape(y, (VB * NG, 128)), S, rows, M, groups, valid)
    c = (row * H * D + h * D)[:, None] + d[None, :]
    tl.store(Q + c, tl.reshape(q, (VB, D)).to(Q.dtype.element_ty), mask=mv[:, None])
