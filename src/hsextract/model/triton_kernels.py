"""The Triton kernels of the fused qwen3_5 forward (QK-norm + RoPE, sigmoid gate), compiled on first use."""

from __future__ import annotations

import types

_TRITON = None


def _triton_kernels():
    global _TRITON
    if _TRITON is not None:
        return _TRITON
    import triton
    import triton.language as tl

    @triton.jit
    def head_vectors(n_vec, T, H, BLOCK_V: tl.constexpr):
        # This program's BLOCK_V head vectors v = (b * T + t) * H + h of a [B, T, H, D] tensor: v, its mask, b, t, h.
        v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        row = v // H
        return v, v < n_vec, row // T, row % T, v % H

    @triton.jit
    def qk_norm_rope_kernel(
        X,
        W,
        COS,
        SIN,
        Y,
        n_vec,
        T,
        H,
        sxb,
        sxt,
        sxh,
        scb,
        sct,
        eps,
        D: tl.constexpr,
        R: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # One program: BLOCK_V head vectors v = (b * T + t) * H + h of length D. y = rope(x / rms(x) * (1 + w)),
        # RoPE on the first R dims (rotate-half convention), all in float32, written contiguous [B, T, H, D].
        v, m_v, b, t, h = head_vectors(n_vec, T, H, BLOCK_V)
        d = tl.arange(0, D)
        x_off = b * sxb + t * sxt + h * sxh
        x = tl.load(X + x_off[:, None] + d[None, :], mask=m_v[:, None], other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None] * (1.0 + tl.load(W + d).to(tl.float32))[None, :]
        if R > 0:
            half: tl.constexpr = R // 2
            in_rot = d < R
            pd = tl.where(d < half, d + half, tl.where(in_rot, d - half, d))
            xp = tl.load(X + x_off[:, None] + pd[None, :], mask=m_v[:, None], other=0.0).to(tl.float32)
            yp = xp * rstd[:, None] * (1.0 + tl.load(W + pd).to(tl.float32))[None, :]
            c_off = b * scb + t * sct
            cd = tl.where(in_rot, d, 0)
            m_c = m_v[:, None] & in_rot[None, :]
            cos = tl.load(COS + c_off[:, None] + cd[None, :], mask=m_c, other=1.0).to(tl.float32)
            sin = tl.load(SIN + c_off[:, None] + cd[None, :], mask=m_c, other=0.0).to(tl.float32)
            sign = tl.where(d < half, -1.0, 1.0)
            y = y * cos + sign[None, :] * yp * sin
        tl.store(Y + v[:, None] * D + d[None, :], y.to(Y.dtype.element_ty), mask=m_v[:, None])

    @triton.jit
    def sigmoid_gate_kernel(
        A,
        G,
        Y,
        n_vec,
        T,
        H,
        sab,
        sat,
        sah,
        sgb,
        sgt,
        sgh,
        D: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # y[b, t, h, :] = a[b, t, h, :] * sigmoid(g[b, t, h, :]) in float32, written contiguous [B, T, H * D].
        v, m_v, b, t, h = head_vectors(n_vec, T, H, BLOCK_V)
        d = tl.arange(0, D)
        a = tl.load(A + (b * sab + t * sat + h * sah)[:, None] + d[None, :], mask=m_v[:, None], other=0.0)
        g = tl.load(G + (b * sgb + t * sgt + h * sgh)[:, None] + d[None, :], mask=m_v[:, None], other=0.0)
        y = a.to(tl.float32) * tl.sigmoid(g.to(tl.float32))
        tl.store(Y + v[:, None] * D + d[None, :], y.to(Y.dtype.element_ty), mask=m_v[:, None])

    _TRITON = types.SimpleNamespace(
        triton=triton, qk_norm_rope=qk_norm_rope_kernel, sigmoid_gate=sigmoid_gate_kernel
    )
    return _TRITON


def _vec_block(d: int) -> int:
    """Head vectors per program: ~2048 elements per program keeps loads wide and the grid large."""
    return max(1, min(16, 2048 // d))


def _launch(k, kernel, n_vec: int, D: int, *args, **meta) -> None:
    """Run ``kernel`` over ``n_vec`` head vectors of length ``D``, ``_vec_block(D)`` of them per program."""
    bv = _vec_block(D)
    kernel[(k.triton.cdiv(n_vec, bv),)](*args, D=D, BLOCK_V=bv, num_warps=4, **meta)


def qk_norm_rope(x, weight, cos, sin, eps: float):
    """``rope(rms_norm_1p(x))`` for x [B, T, H, D] (any strides, last dim contiguous), cos/sin [B, T, R] with
    R <= D (partial rotary, rotate-half). Returns a new contiguous [B, T, H, D] tensor."""
    import torch

    k = _triton_kernels()
    B, T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos.expand(B, T, cos.shape[-1])
    sin = sin.expand(B, T, sin.shape[-1])
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    R = cos.shape[-1]
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    n_vec = B * T * H
    x_strides, c_strides = x.stride()[:3], cos.stride()[:2]
    _launch(
        k, k.qk_norm_rope, n_vec, D, x, weight, cos, sin, y, n_vec, T, H, *x_strides, *c_strides, eps, R=R
    )
    return y


def sigmoid_gate(attn, gate):
    """``attn * sigmoid(gate)`` for attn, gate [B, T, H, D] (any strides, last dim contiguous), in float32;
    returns a new contiguous [B, T, H * D] tensor."""
    import torch

    k = _triton_kernels()
    B, T, H, D = attn.shape
    if attn.stride(-1) != 1:
        attn = attn.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    y = torch.empty((B, T, H * D), dtype=attn.dtype, device=attn.device)
    n_vec = B * T * H
    _launch(k, k.sigmoid_gate, n_vec, D, attn, gate, y, n_vec, T, H, *attn.stride()[:3], *gate.stride()[:3])
    return y
