"""fp8 compute as FP8-served targets run (Qwen3.x-FP8 in vLLM and SGLang): the recipe, its linear, the conversion.

One recipe, written once below, in both directions; ``Fp8Linear`` runs it as a block-scaled GEMM on a GPU that has
them (Hopper), the activations quantized by the kernel that produces them where the fused forward runs
(fp8_kernels.py), and emulated in float32 elsewhere, so that the CPU tests compute the same numbers.
"""

# The recipe (block B = 128):
#     weights      s_w[i, j] = amax(W[Bi:Bi+B, Bj:Bj+B]) / 448       Wq = e4m3(W / s_w)     W ~ Wq * s_w
#     activations  s_x[t, j] = amax(x[t, Bj:Bj+B]) / 448             xq = e4m3(x / s_x)    (per token, per B columns)
#     y[t, n]      = sum_j s_x[t, j] * s_w[n // B, j] * (xq[t, Bj:Bj+B] . Wq[n, Bj:Bj+B])   float32 accumulation
# e4m3 rounds to nearest even and saturates at +-448; an all-zero block has scale 0 and values 0. Qwen's FP8
# checkpoints store s_w as `weight_scale_inv` (the multiplier that dequantizes, despite its name) in bf16; it is
# taken as float32. A linear computes in fp8 exactly when it has such a scale.

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
GEMM_ALIGN = 4 * BLOCK


# -- the recipe, in plain torch -------------------------------------------------------------------------------------
def _divisor(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    # The clamp only guards amax / (amax / 448) rounding a hair above 448.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_weight(
    w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq e4m3 [N, K], s_w float32 [ceil(N/B), ceil(K/B)])`` of ``w`` [N, K]. ``scale_dtype``: the dtype the
    scale is stored in (Qwen's files: bf16); the values are divided by the stored scale, so that ``Wq * s_w`` is
    what a reader of the file computes."""
    n, k = w.shape
    gn, gk = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(gn * BLOCK, gk * BLOCK, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(gn, BLOCK, gk, BLOCK)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).to(scale_dtype).float()
    q = _to_fp8(tiles / _divisor(scale)[:, None, :, None]).view(gn * BLOCK, gk * BLOCK)[:n, :k].contiguous()
    return q, scale


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``Wq * s_w`` [N, K] in ``dtype`` (float32 arithmetic)."""
    n, k = q.shape
    full = scale.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (q.float() * full).to(dtype)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq e4m3 [..., K], s_x float32 [..., ceil(K/B)])`` of ``x`` [..., K]: one scale per token per B columns."""
    k = x.shape[-1]
    g = -(-k // BLOCK)
    xf = x.float()
    if k % BLOCK:
        xf = torch.nn.functional.pad(xf, (0, g * BLOCK - k))
    groups = xf.view(*x.shape[:-1], g, BLOCK)
    scale = groups.abs().amax(dim=-1) / FP8_MAX
    q = _to_fp8(groups / _divisor(scale).unsqueeze(-1)).view(*x.shape[:-1], g * BLOCK)[..., :k]
    return q, scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``xq * s_x`` in float32."""
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(BLOCK, -1)[..., :k]


def fake_quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the recipe's GEMM sees it: quantized per token per B columns and back, float32."""
    return dequantize_activation(*quantize_activation(x))


# -- the linear ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fp8Activation:
    """An activation a producing kernel already quantized: ``q`` [Mp, K] e4m3, ``scale`` [Mp, K/B] float32 laid out
    as ``torch._scaled_mm`` takes it (outer-dim-major: a [K/B, Mp] tensor transposed), Mp >= M rows (the extra ones
    zero: fp8_kernels.ROW_ALIGN), ``shape`` the activation's shape (M rows of K), ``dtype`` the GEMM's output's."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: tuple
    dtype: torch.dtype


_SCALED_MM: dict = {}


def scaled_mm_available(device: torch.device) -> bool:
    """True on a CUDA device whose cuBLASLt runs block-scaled fp8 GEMMs (compute capability 9.0, Hopper)."""
    if device.type != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SCALED_MM:
        _SCALED_MM[key] = torch.cuda.get_device_capability(key) == (9, 0) and hasattr(torch, "_scaled_mm")
    return _SCALED_MM[key]


class Fp8Linear(nn.Module):
    """A linear layer of e4m3 weights with a float32 scale per 128x128 tile, computing the recipe (module
    docstring). ``forward`` takes a tensor [..., K] (quantized here) or an ``Fp8Activation``."""

    joins = 0
    """How many of the checkpoint's linears this one computes at once (qwen3_5_fp8.join); 0: it is one of them."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale_inv", scale.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks {BLOCK}x{BLOCK}"

    @property
    def gemm_ready(self) -> bool:
        """Whether this linear runs ``torch._scaled_mm`` (else the emulated recipe): cuBLASLt refused a 384 x 256
        weight (3 x 2 tiles) on an H200; Qwen's dimensions are all multiples of ``GEMM_ALIGN``."""
        return (
            scaled_mm_available(self.weight.device)
            and self.in_features % GEMM_ALIGN == 0
            and self.out_features % GEMM_ALIGN == 0
        )

    def forward(self, x):
        if isinstance(x, Fp8Activation) and not self.gemm_ready:
            rows = math.prod(x.shape[:-1])
            xf = dequantize_activation(x.q[:rows], x.scale[:rows])
            w = dequantize_weight(self.weight, self.weight_scale_inv)
            out = (xf @ w.t()).to(x.dtype).view(*x.shape[:-1], self.out_features)
        elif isinstance(x, Fp8Activation):
            out = block_scaled_mm(x.q, x.scale, self.weight, self.weight_scale_inv, x.dtype)
            out = out[: math.prod(x.shape[:-1])].view(*x.shape[:-1], self.out_features)
        elif self.gemm_ready:
            from hsextract.model.fp8_kernels import quantize_rows

            q, s = quantize_rows(x.reshape(-1, x.shape[-1]))
            out = block_scaled_mm(q, s, self.weight, self.weight_scale_inv, x.dtype)
            out = out[: math.prod(x.shape[:-1])].view(*x.shape[:-1], self.out_features)
        else:
            w = dequantize_weight(self.weight, self.weight_scale_inv)
            out = (fake_quantize_activation(x) @ w.t()).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out


def block_scaled_mm(q, scale, weight, weight_scale, out_dtype) -> torch.Tensor:
    """``q`` [M, K] e4m3 with ``scale`` [M, K/B] (outer-dim-major) times ``weight`` [N, K] e4m3 with
    ``weight_scale`` [N/B, K/B] (row-major), transposed: [M, N] in ``out_dtype``, float32 accumulation."""
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.t(), out_dtype=out_dtype)


# -- which linears, and converting a model ---------------------------------------------------------------------------
def convertible(name: str, module: nn.Module) -> bool:
    """The linears ``--compute fp8`` quantizes in a bf16 checkpoint: every plain ``nn.Linear`` inside a decoder
    layer whose two dimensions are multiples of 128, as Qwen's FP8 checkpoints convert them (the Gated-DeltaNet's
    ``in_proj_a``/``in_proj_b``, 48 outputs, stay; so do ``lm_head`` and the embeddings, outside the layers)."""
    return (
        type(module) is nn.Linear
        and ".layers." in f".{name}"
        and module.in_features % BLOCK == 0
        and module.out_features % BLOCK == 0
    )


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def to_fp8(lm: nn.Module, scales: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Replace linears of ``lm`` by ``Fp8Linear``, in place; returns their names. With ``scales`` (module name ->
    the checkpoint's ``weight_scale_inv``) exactly those, whose weights hold e4m3 values already (a cast back to
    e4m3 is exact); without, every ``convertible`` linear, quantized by the recipe."""
    done = []
    for name, mod in list(lm.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        if scales is not None:
            if name not in scales:
                continue
            q = mod.weight.detach().to(FP8)
            scale = scales[name].to(device=q.device, dtype=torch.float32)
            expected = (-(-q.shape[0] // BLOCK), -(-q.shape[1] // BLOCK))
            if tuple(scale.shape) != expected:
                from hsextract.errors import HsextractError

                raise HsextractError(
                    f"{name}.weight_scale_inv has shape {tuple(scale.shape)}, expected {expected} for a "
                    f"{tuple(q.shape)} weight in 128x128 blocks: not the FP8 layout hsextract reads"
                )
        elif convertible(name, mod):
            q, scale = quantize_weight(mod.weight.detach())
        else:
            continue
        bias = None if mod.bias is None else mod.bias.detach()
        new = Fp8Linear(q, scale, bias)
        mod.weight = None  # the bf16 copy goes now, one layer at a time, not after the whole model
        _set_module(lm, name, new)
        done.append(name)
    return done


def to_dense(lm: nn.Module, dtype: torch.dtype) -> list[str]:
    """Replace every ``Fp8Linear`` by an ``nn.Linear`` of its dequantized weights in ``dtype``: an FP8 checkpoint
    on hardware without block-scaled fp8 GEMMs, or with ``--compute bf16``."""
    done = []
    for name, mod in list(lm.named_modules()):
        if isinstance(mod, Fp8Linear):
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            lin.weight = nn.Parameter(dequantize_weight(mod.weight, mod.weight_scale_inv, dtype), False)
            if mod.bias is not None:
                lin.bias = nn.Parameter(mod.bias.to(dtype), False)
            _set_module(lm, name, lin)
            done.append(name)
    return done


def fp8_linears(lm: nn.Module) -> list[str]:
    return [name for name, mod in lm.named_modules() if isinstance(mod, Fp8Linear)]
