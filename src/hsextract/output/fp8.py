"""What a stored state means beyond its bytes: fp8 storage with a scale per vector, and the final norm.

fp8: one float32 scale per token per layer (``absmax / 448``), since a token's layers differ by orders of magnitude;
a NaN or Inf makes its scale non-finite, so the health checks still see it. The final norm: the last layer's raw
output is stored with the norm's weight, epsilon and rule, and ``FinalNorm.from_module`` keeps the rule (Llama's or
``1 + weight``) that reproduces the model's own norm on a probe.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_fp8_(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """``x`` [..., H] (any float dtype) into ``out`` [..., H] float8_e4m3fn and ``scale_out`` [...] float32."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / FP8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    # The clamp only guards the rounding of absmax / (absmax / 448) a hair above 448: the cast saturates on CPU,
    # but an overflowing cast is not specified everywhere.
    out.copy_((xf / divisor).clamp_(-FP8_MAX, FP8_MAX))
    scale_out.copy_(scale)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values, float32 scales)`` of ``x`` [..., H], one scale per vector of the last dimension."""
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    quantize_fp8_(x, out, scale)
    return out, scale


DEQUANTIZE_PIECE = 1 << 20

"""Values dequantized at a time into a given ``out``: the float32 intermediate stays a few MB."""


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The states ``q`` [..., H] (fp8) with ``scale`` [...] applied, in ``dtype``; into ``out`` (``dtype``, the
    shape of ``q``) when given, a piece of the first dimension at a time, with the same float32 arithmetic."""
    if out is None:
        return (q.float() * scale.unsqueeze(-1)).to(dtype)
    rows = max(1, DEQUANTIZE_PIECE // max(1, q[0].numel())) if q.dim() > 1 and len(q) else 1
    for a in range(0, len(q), rows):
        piece = q[a : a + rows].float()
        piece.mul_(scale[a : a + rows].unsqueeze(-1))
        out[a : a + rows].copy_(piece)
    return out


def quantization_error(x: torch.Tensor) -> dict:
    """Relative L2 error and cosine similarity of ``x`` [tokens, H] after an fp8 round trip, computed in float64:
    ``rel_l2`` over the whole tensor, ``cos_min`` and ``cos_mean`` over its token vectors."""
    q, s = quantize_fp8(x)
    back = dequantize_fp8(q, s, torch.float64)
    ref = x.double()
    rel = ((back - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(back, ref, dim=-1)
    return {"rel_l2": rel, "cos_min": cos.min().item(), "cos_mean": cos.mean().item()}
