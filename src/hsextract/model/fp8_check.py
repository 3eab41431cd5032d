"""The dry run's proof of fp8 compute: stored states held against the served recipe and against its wrong variants.

A correct implementation is nearer the recipe than any plausible mistake in it, so each variant runs through
transformers' own forward (its fp8 linears in float32, as tests/support/fp8ref.py does apart from this code) and the
capture's distance to each is reported per layer; the weights and scales are first held to the checkpoint's files,
since a load that transposed or inverted them would otherwise be the reference too.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from hsextract.model.fp8 import BLOCK, FP8, FP8_MAX, Fp8Linear, dequantize_weight

RECIPE = "recipe"
BF16 = "bf16 weights"
VARIANTS = (
    RECIPE,
    "activations not quantized",
    "one scale per token",
    "scales inverted",
    "scales transposed",
    "scales ignored",
    BF16,
)
"""The served recipe, then its wrong variants; the last is also the bf16 target's states (for information)."""


def fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [..., K] quantized to e4m3 with one scale (amax / 448) per ``group`` columns and back, float32."""
    k = x.shape[-1]
    pad = -k % group
    g = torch.nn.functional.pad(x.float(), (0, pad)).view(*x.shape[:-1], -1, group)
    s = g.abs().amax(-1, keepdim=True) / FP8_MAX
    q = (g / torch.where(s > 0, s, torch.ones_like(s))).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.float() * s).view(*x.shape[:-1], k + pad)[..., :k]


def _variant_weight(mod: Fp8Linear, variant: str) -> torch.Tensor:
    s = mod.weight_scale_inv
    if variant == "scales inverted":
        s = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    elif variant == "scales transposed":
        s = s.t().contiguous().view(s.shape)
    elif variant == "scales ignored":
        s = torch.ones_like(s)
    return dequantize_weight(mod.weight, s)


def _forward(mod: Fp8Linear, variant: str, bf16_weight, x: torch.Tensor) -> torch.Tensor:
    if variant == BF16:  # the bf16 target: its own weights, the linear in the model's dtype
        w = bf16_weight(mod)
        out = nn.functional.linear(x, w.to(device=x.device, dtype=x.dtype))
    else:
        group = mod.in_features if variant == "one scale per token" else BLOCK
        a = x.float() if variant == "activations not quantized" else fake_quantize(x, group)
        out = (a @ _variant_weight(mod, variant).t()).to(x.dtype)
    return out if mod.bias is None else out + mod.bias


@contextlib.contextmanager
def variant_linears(lm: nn.Module, variant: str, bf16_weight):
    """Every ``Fp8Linear`` of ``lm`` computes ``variant`` inside the block (an instance ``forward``, then removed).
    ``bf16_weight(module)``: the bf16 target's weight of a linear."""
    mods = [m for m in lm.modules() if isinstance(m, Fp8Linear)]
    for m in mods:
        m.forward = types.MethodType(lambda self, x, v=variant: _forward(self, v, bf16_weight, x), m)
    try:
        yield
    finally:
        for m in mods:
            del m.forward


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of ``a`` from ``b``; infinite where either is not finite (inverted scales overflow)."""
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else float("inf")


def recipe_distances(lm, layers, samples, states, bf16_weight, device) -> dict:
    """layer id -> variant -> the relative L2 distance of ``states`` from that variant's states. ``samples``: token
    id arrays; ``states``: per sample a [tokens, len(layers), hidden] tensor of the capture (decoder layer
    outputs, before any final norm); ``layers``: the decoder-layer ids of its slots."""
    from hsextract.model import qwen3_5 as kernels
    from hsextract.model.load import decoder_layers

    blocks = decoder_layers(lm)
    seen: dict = {}
    hooks = [
        blocks[k].register_forward_hook(
            lambda m, a, out, k=k: seen.__setitem__(
                k, (out if torch.is_tensor(out) else out[0])[0].float().cpu()
            )
        )
        for k in sorted(set(layers))
    ]
    refs = {v: {k: [] for k in layers} for v in VARIANTS}
    try:
        with torch.inference_mode(), kernels.stock_forward(lm):
            for variant in VARIANTS:
                with variant_linears(lm, variant, bf16_weight):
                    for ids in samples:
                        seen.clear()
                        lm(torch.tensor(ids, dtype=torch.long, device=device)[None], use_cache=False)
                        for k in layers:
                            refs[variant][k].append(seen[k])
    finally:
        for h in hooks:
            h.remove()
    table = {}
    for j, k in enumerate(layers):
        mine = torch.cat([s[:, j].float() for s in states])
        table[k] = {v: rel(mine, torch.cat(refs[v][k])) for v in VARIANTS}
    return table


def verdict(table: dict) -> list[str]:
    """Warnings: each layer whose states are not nearest the recipe, naming the variant they are nearer."""
    warnings = []
    for k, dist in table.items():
        nearest = min(VARIANTS[1:], key=lambda v: dist[v])
        if not dist[RECIPE] < dist[nearest]:
            warnings.append(
                f"layer {k}: the fp8 states are nearer '{nearest}' ({dist[nearest]:.2e}) than the served recipe "
                f"({dist[RECIPE]:.2e}): the fp8 compute does not follow the checkpoint's recipe"
            )
    return warnings


# -- the checkpoint's own files --------------------------------------------------------------------------------------
class CheckpointLinears:
    """The checkpoint's tensors of each ``Fp8Linear`` of ``lm``, read from its files on demand (memory-mapped). A
    joined linear of the fused forward is not one of them: its parts, the checkpoint's, are views of it."""

    def __init__(self, lm, model: str):
        from safetensors import safe_open

        from hsextract.model.fp8_load import module_keys, weight_files

        self.modules = {n: m for n, m in lm.named_modules() if isinstance(m, Fp8Linear) and not m.joins}
        self.names = {id(m): n for n, m in self.modules.items()}
        self.where = {}
        for path in weight_files(model):
            with safe_open(str(path), framework="pt") as f:
                keys = [k for k in f.keys() if k.endswith(".weight")]
            for module, key in module_keys(lm, keys).items():
                if module in self.modules:
                    self.where[module] = (path, key.removesuffix(".weight"))

    def tensor(self, module: str, suffix: str) -> torch.Tensor:
        from safetensors import safe_open

        path, prefix = self.where[module]
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(prefix + suffix)

    def bf16_weight(self, fp8_checkpoint: bool):
        """``bf16_weight(module)`` for ``variant_linears``: an FP8 checkpoint's dequantized weight (its bf16 target
        is what ``--compute bf16`` computes), a bf16 checkpoint's own weight."""

        def weight(mod: Fp8Linear) -> torch.Tensor:
            if fp8_checkpoint:
                return dequantize_weight(mod.weight, mod.weight_scale_inv)
            return self.tensor(self.names[id(mod)], ".weight")

        return weight

    def mismatches(self) -> list[str]:
        """An FP8 checkpoint's linears whose loaded e4m3 weight or tile scale is not its files' (or not found)."""
        bad = []
        for name, mod in self.modules.items():
            if name not in self.where:
                bad.append(name)
                continue
            w = self.tensor(name, ".weight").to(mod.weight.device)
            s = self.tensor(name, ".weight_scale_inv").to(device=mod.weight.device, dtype=torch.float32)
            same_w = w.dtype == FP8 and torch.equal(w.view(torch.uint8), mod.weight.view(torch.uint8))
            if not (same_w and torch.equal(s, mod.weight_scale_inv)):
                bad.append(name)
        return bad


def check_compute(lm, model: str, fp8_checkpoint: bool, layers, samples, states, device) -> dict:
    """The dry run's fp8 section: the load checked against the checkpoint's files (an FP8 checkpoint), then the
    distances of the capture ``states`` of ``samples`` from the recipe and each variant per layer, and warnings."""
    files = CheckpointLinears(lm, model)
    mismatched = files.mismatches() if fp8_checkpoint else []
    table = recipe_distances(lm, layers, samples, states, files.bf16_weight(fp8_checkpoint), device)
    warnings = verdict(table)
    if mismatched:
        warnings.insert(
            0,
            f"{len(mismatched)} fp8 linear(s) loaded with weights or scales other than the checkpoint's files "
            f"(first: {mismatched[0]})",
        )
    return {
        "linears": len(files.modules),
        "checked_against_files": fp8_checkpoint,
        "mismatched_linears": mismatched,
        "samples": len(samples),
        "tokens": int(sum(len(s) for s in samples)),
        "bf16_target": "the checkpoint's dequantized weights in bf16"
        if fp8_checkpoint
        else "the checkpoint's own bf16 weights",
        "layers": {str(k): v for k, v in table.items()},
        "warnings": warnings,
        "ok": not warnings,
    }
