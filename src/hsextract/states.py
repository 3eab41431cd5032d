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

from dataclasses import dataclass

import torch

from .errors import HsextractError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
STORAGE_DTYPES = ("float8_e4m3fn",)


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


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The states ``q`` [..., H] (fp8) with ``scale`` [...] applied, in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def quantization_error(x: torch.Tensor) -> dict:
    """Relative L2 error and cosine similarity of ``x`` [tokens, H] after an fp8 round trip, computed in float64:
    ``rel_l2`` over the whole tensor, ``cos_min`` and ``cos_mean`` over its token vectors."""
    q, s = quantize_fp8(x)
    back = dequantize_fp8(q, s, torch.float64)
    ref = x.double()
    rel = ((back - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(back, ref, dim=-1)
    return {"rel_l2": rel, "cos_min": cos.min().item(), "cos_mean": cos.mean().item()}


RULES = ("weight", "one_plus_weight")


@dataclass(frozen=True)
class FinalNorm:
    """An RMSNorm as the model applies it after its last decoder layer."""

    weight: torch.Tensor
    """[H], in the dtype the model holds it."""
    eps: float
    rule: str
    """``weight``: ``weight * normed.to(dtype)`` (Llama, Qwen3). ``one_plus_weight``: ``(normed_f32 *
    (1 + weight_f32)).to(dtype)`` (Qwen3.5, Gemma). ``normed`` is ``x_f32 * rsqrt(mean(x_f32^2) + eps)``."""

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"unknown final-norm rule {self.rule!r}; expected one of {RULES}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The normed state of ``x`` [..., H], in ``x``'s dtype."""
        dtype = x.dtype
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(x.device)
        if self.rule == "one_plus_weight":
            return (normed * (1.0 + w.float())).to(dtype)
        return (w.to(dtype) * normed.to(dtype)).to(dtype)

    @classmethod
    def from_module(cls, norm) -> FinalNorm:
        """Read the model's final norm module: its weight, its epsilon, and (by probing it) its rule."""
        name = type(norm).__name__
        weight = getattr(norm, "weight", None)
        eps = next((getattr(norm, a) for a in ("eps", "variance_epsilon") if hasattr(norm, a)), None)
        if weight is None or eps is None or getattr(norm, "bias", None) is not None:
            raise HsextractError(
                f"--final-state: the model's final norm ({name}) is not an RMSNorm with a weight and an epsilon; "
                "hsextract cannot derive its normed state from the stored one"
            )
        weight = weight.detach()
        g = torch.Generator(device="cpu").manual_seed(0)
        probe = (torch.randn(4, weight.numel(), generator=g) * 3).to(weight.device, weight.dtype)
        with torch.no_grad():
            want = norm(probe).float()
        errors = {}
        for rule in RULES:
            got = cls(weight=weight, eps=float(eps), rule=rule)(probe).float()
            errors[rule] = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        rule = min(errors, key=errors.get)
        tolerance = 1e-5 if weight.dtype == torch.float32 else 1e-2
        if errors[rule] > tolerance:
            raise HsextractError(
                f"--final-state: the model's final norm ({name}) follows neither RMSNorm rule hsextract knows "
                f"(relative difference {errors}); its normed state cannot be derived from the stored one"
            )
        return cls(weight=weight.cpu().clone(), eps=float(eps), rule=rule)

    def describe(self) -> dict:
        return {"eps": self.eps, "rule": self.rule, "dtype": str(self.weight.dtype).removeprefix("torch.")}


def model_final_norm(lm) -> FinalNorm:
    """The final norm of a loaded model as transformers defines it: probed with transformers' own forwards in
    place, should fused kernels (kernels.py) be swapped in."""
    from . import kernels
    from .capture import final_norm

    with kernels.stock_forward(lm):
        return FinalNorm.from_module(final_norm(lm))


def write_final_norm(sink, norm: FinalNorm) -> None:
    """``final_norm.safetensors`` in the output: the weight as the model holds it, epsilon and rule as metadata.
    The same bytes from every shard, so any shard may write it, any number of times."""
    from safetensors.torch import save

    from .output import FINAL_NORM

    meta = {"eps": repr(norm.eps), **{k: str(v) for k, v in norm.describe().items() if k != "eps"}}
    sink.put_bytes(FINAL_NORM, save({"weight": norm.weight.contiguous()}, metadata=meta))


def read_final_norm(sink, recorded: dict, *, verify: bool = True) -> FinalNorm:
    """The final norm a ``--final-state`` output holds; ``recorded`` is the manifest's ``final_state.norm``, which
    the file's bytes are checked against when ``verify``."""
    from safetensors.torch import load

    from .errors import CorruptOutputError
    from .output import describe_final_norm, read_checked_final_norm

    data = read_checked_final_norm(sink, recorded, verify=verify)
    meta = describe_final_norm(sink, data)
    try:
        weight = load(data)["weight"]
    except Exception as e:  # noqa: BLE001 - any unreadable file is a damaged output
        raise CorruptOutputError(
            sink.url, recorded["key"], f"is not a final norm hsextract wrote ({e})"
        ) from None
    return FinalNorm(weight=weight, eps=meta["eps"], rule=meta["rule"])
