"""Triton kernels that end in the fp8 recipe's activation quantization (fp8.py): each writes e4m3 values and one
float32 scale per token per 128 columns straight from its float32 result, so no pass over a bf16 activation is left
between the kernel that produces it and the block-scaled GEMM that reads it.
"""

# Each returns (q [Mp, K] e4m3, scale [Mp, K/128]), the scale a [K/128, Mp] tensor transposed: the outer-dim-major
# layout torch._scaled_mm takes for 1x128 blocks; Mp is the M rows rounded up to ROW_ALIGN, the extra rows zero.
# quantize_rows: any [M, K] activation (the input of a linear whose producer is not fused); rms_norm_quant: Qwen3.5's
# RMSNorm x / rms(x) * (1 + w), optionally after s = residual + x (the sum, rounded to the activation dtype as stock,
# written too) and optionally the normed bf16 as well (the Gated-DeltaNet's in_proj_a/in_proj_b stay bf16 linears and
# read it); silu_mul_quant: silu(g) * u from the joined gate/up GEMM's [M, 2I] output; gated_rms_norm_quant: the
# Gated-DeltaNet's w * o / rms(o) * silu(z) per head vector; sigmoid_gate_quant: attention output * sigmoid(gate).

from __future__ import annotations

_K = None

GROUP = 128


def _kernels():
    """fp8_triton.py (its kernels, and ``triton`` for the launch grids), imported at the first call."""
    global _K
    if _K is None:
        from hsextract.model import fp8_triton

        _K = fp8_triton
    return _K


ROW_ALIGN = 16

"""Rows of the quantized buffers are a multiple of this: cuBLASLt's block-scaled GEMM refuses some row counts
(``CUBLAS_STATUS_NOT_SUPPORTED`` at 777 rows on an H200), so the buffers are padded with zero rows (scale 0) and
the GEMM's extra output rows dropped (``fp8.block_scaled_mm``)."""


def _outputs(M: int, K: int, device):
    """The e4m3 values [Mp, K] and scales [K/128, Mp] (Mp: M rounded up to ``ROW_ALIGN``), padding rows zero."""
    import torch

    mp = -(-M // ROW_ALIGN) * ROW_ALIGN
    q = torch.empty((mp, K), dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty((K // GROUP, mp), dtype=torch.float32, device=device)
    if mp > M:
        q[M:].zero_()
        s[:, M:].zero_()
    return q, s


def _check_k(K: int) -> None:
    if K % GROUP:
        raise ValueError(f"fp8 activation quantization needs a multiple of {GROUP} columns, got {K}")


def quantize_rows(x):
    """``x`` [M, K] (last dim contiguous) -> ``(q, scale)`` by the recipe."""
    k = _kernels()
    M, K = x.shape
    _check_k(K)
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, s = _outputs(M, K, x.device)
    ng = min(8, k.triton.next_power_of_2(K // GROUP))
    k.quantize_rows[(M, k.triton.cdiv(K // GROUP, ng))](
        x, q, s, s.shape[1], K, x.stride(0), NG=ng, num_warps=4
    )
    return q, s.t()


def rms_norm_quant(x, weight, eps: float, residual=None, normed: bool = False):
    """``rms_norm_1p(x)`` [M, K] quantized: ``(q, scale)``, then the sum ``residual + x`` when ``residual`` is
    given, then the normed activation in ``x``'s dtype when ``normed``."""
    import torch

    k = _kernels()
    M, K = x.shape
    _check_k(K)
    q, s = _outputs(M, K, x.device)
    total = torch.empty_like(x) if residual is not None else x
    out = torch.empty_like(x) if normed else x
    block = k.triton.next_power_of_2(K)
    k.rms_norm_quant[(M,)](
        x,
        residual if residual is not None else x,
        weight,
        q,
        s,
        total,
        out,
        s.shape[1],
        K,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        eps,
        HAS_RES=residual is not None,
        HAS_NORMED=normed,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
    )
    result = (q, s.t())
    if residual is not None:
        result += (total,)
    if normed:
        result += (out,)
    return result


def silu_mul_quant(gu):
    """``silu(gu[:, :I]) * gu[:, I:]`` quantized, for the joined gate/up output ``gu`` [M, 2I]."""
    k = _kernels()
    M, I2 = gu.shape
    inner = I2 // 2
    _check_k(inner)
    q, s = _outputs(M, inner, gu.device)
    ng = min(8, k.triton.next_power_of_2(inner // GROUP))
    k.silu_mul_quant[(M, k.triton.cdiv(inner // GROUP, ng))](
        gu, q, s, s.shape[1], inner, gu.stride(0), NG=ng, num_warps=4
    )
    return q, s.t()


def _head_quant(a, g, weight, eps: float, gated_norm: bool):
    """``a``, ``g`` [B, T, H, D] (any strides but the last, which is 1) -> ``(q [B * T, H * D], scale)``."""
    k = _kernels()
    B, T, H, D = a.shape
    _check_k(D)
    if a.stride(-1) != 1:
        a = a.contiguous()
    if g.stride(-1) != 1:
        g = g.contiguous()
    M = B * T
    q, s = _outputs(M, H * D, a.device)
    vb = max(1, 2048 // D)  # ~2048 elements a program: wide loads, a large grid
    k.head_quant[(k.triton.cdiv(M * H, vb),)](
        a,
        g,
        weight if weight is not None else a,
        q,
        s,
        s.shape[1],
        M * H,
        T,
        H,
        *a.stride()[:3],
        *g.stride()[:3],
        eps,
        D=D,
        GATED_NORM=gated_norm,
        VB=vb,
        num_warps=4,
    )
    return q, s.t()


def gated_rms_norm_quant(o, z, weight, eps: float):
    """The Gated-DeltaNet's output norm ``weight * rms_norm(o) * silu(z)`` quantized; ``o``, ``z`` [B, T, H, D]."""
    return _head_quant(o, z, weight, eps, True)


def sigmoid_gate_quant(attn, gate):
    """``attn * sigmoid(gate)`` quantized; ``attn``, ``gate`` [B, T, H, D]."""
    return _head_quant(attn, gate, None, 0.0, False)
