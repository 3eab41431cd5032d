"""What a stored state means beyond its bytes: fp8 storage with a scale per vector, and the final norm.

fp8 (``--storage-dtype float8_e4m3fn``). Every stored vector (one token of one captured layer, ``H`` values) gets
its own float32 scale ``absmax / 448`` (448 is float8_e4m3fn's largest finite value) and is stored as
``x / scale`` in float8_e4m3fn, so its largest entry lands on 448 and the 3-bit mantissa gives every entry about
2^-4 relative precision. One scale per token per layer, not per token: the layers of one token differ by orders of
magnitude in norm (the last ones are large), and a shared scale would flush the small layers' entries to zero.
The scales cost 4 bytes per vector (0.08% of a 5120-wide state). Quantizing runs on the device inside the capture
hooks, so only fp8 bytes and scales cross the host link. An all-zero vector gets scale 0 and stays all zeros; a
NaN or Inf in a vector makes its scale non-finite, so the dequantized vector is non-finite too and the health checks
still see it.

The final norm (``--final-state``). hsextract stores the last decoder layer's raw output (before the final norm)
and, once per output, the norm's weight, epsilon and scaling rule, so that HF's ``output_hidden_states[-1]`` (the
normed state that EAGLE-3 trainers feed to the frozen lm_head) is derived exactly, in the stored dtype, the way the
model's own norm class computes it. Two RMSNorm rules exist among transformers' decoders: Llama-style
``weight * normed.to(dtype)`` and Qwen3.5/Gemma-style ``(normed_f32 * (1 + weight_f32)).to(dtype)``. Which one a
model uses is not guessed from its class name: ``FinalNorm.from_module`` runs the model's own norm module on a
probe and keeps the rule that reproduces it; a norm that follows neither (a LayerNorm with a bias, say) is refused.
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
