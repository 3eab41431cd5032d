"""Loading a target for ``--compute``: an FP8-served checkpoint as it is stored, or a bf16 one quantized on load.

transformers builds the model as an unquantized one (its FP8 integration needs the ``kernels`` Hub package and
dequantizes on a CPU), so the e4m3 values land exactly in ``--dtype`` parameters; then every linear the checkpoint
gives a ``weight_scale_inv`` becomes an ``Fp8Linear`` of those values and that scale, and nothing else changes.
"""

# The FP8 layout read: Qwen3.x-FP8's, quantization_config with quant_method fp8, weight_block_size [128, 128],
# dynamic activations; e4m3 weights, a weight_scale_inv per 128x128 tile. modules_to_not_convert is not read: its
# names are multimodal paths and include parameters. Which checkpoint key is which module is transformers' own
# renaming (conversion_mapping), as its loader applies it.
# --compute: auto (the checkpoint's own numerics), fp8 (also a bf16 checkpoint, quantized on load by fp8.py's
# recipe), bf16 (an FP8 checkpoint dequantized on load). On a GPU without block-scaled fp8 GEMMs (before Hopper) an
# FP8 checkpoint is dequantized on load, saying so; on the CPU the recipe runs emulated in float32.

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from hsextract.config import COMPUTE_MODES
from hsextract.errors import HsextractError

log = logging.getLogger(__name__)


SCALE_SUFFIX = ".weight_scale_inv"


def quantization_config(model: str, config=None) -> dict | None:
    """The checkpoint's ``quantization_config`` (from ``config.json`` of a local directory, else ``config``'s)."""
    path = Path(model) / "config.json"
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            raw = {}
        qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    else:
        qc = getattr(config, "quantization_config", None) if config is not None else None
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc or None


def is_fp8_checkpoint(model: str, config=None) -> bool:
    """True for the served FP8 layout; a clear error for an fp8 layout hsextract does not compute as served."""
    qc = quantization_config(model, config)
    if not qc or qc.get("quant_method") != "fp8":
        return False
    block = qc.get("weight_block_size")
    if list(block or []) != [128, 128]:
        raise HsextractError(
            f"--model {model}: fp8 checkpoint with weight_block_size {block}; hsextract computes the served "
            "layout of 128x128 weight blocks only (Qwen3.x-FP8's). Use the bf16 checkpoint"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise HsextractError(
            f"--model {model}: fp8 checkpoint with activation_scheme {scheme!r}; hsextract computes dynamic "
            "activation scales only. Use the bf16 checkpoint"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise HsextractError(f"--model {model}: fp8 format {fmt!r}; hsextract reads e4m3 weights only")
    return True


def resolve_compute(requested: str, fp8_checkpoint: bool) -> str:
    """``fp8`` or ``bf16``: what ``--compute`` means for this checkpoint (``auto``: its own numerics)."""
    if requested not in COMPUTE_MODES:
        raise HsextractError(f"--compute {requested!r}: choose one of {', '.join(COMPUTE_MODES)}")
    if requested == "auto":
        return "fp8" if fp8_checkpoint else "bf16"
    return requested


def unquantized_config(model: str):
    """The model's config without its ``quantization_config``: transformers then builds plain linears."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if "quantization_config" in c.__dict__:
            del c.__dict__["quantization_config"]
    return config


def weight_files(model: str) -> list[Path]:
    """The checkpoint's safetensors files (those its index names, when it has one)."""
    root = Path(model)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    return sorted(root.glob("*.safetensors"))


def read_scales(model: str) -> dict[str, object]:
    """Each checkpoint linear's ``weight_scale_inv`` (float32), by the checkpoint's module name."""
    import torch
    from safetensors import safe_open

    scales = {}
    for path in weight_files(model):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith(SCALE_SUFFIX):
                    scales[key[: -len(SCALE_SUFFIX)]] = f.get_tensor(key).to(torch.float32)
    if not scales:
        raise HsextractError(
            f"--model {model}: its config says fp8 but no weight file holds a '*{SCALE_SUFFIX}' tensor"
        )
    return scales


def module_keys(lm, keys) -> dict[str, str]:
    """The loaded model's module name -> the checkpoint key (``*.weight``) it was loaded from, by transformers'
    renaming of checkpoint keys; keys of modules the model does not have (a vision tower, MTP layers) are left out."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    renamings = get_model_conversion_mapping(lm)
    modules = dict(lm.named_modules())
    out = {}
    for source in keys:
        key = source
        for rename in renamings:
            key, _ = rename.rename_source_key(key)
        target = key.removesuffix(".weight")
        if target in modules:
            out[target] = source
    return out


def scales_by_module(lm, checkpoint_scales: dict) -> dict:
    """``checkpoint_scales`` keyed by the loaded model's module names (``module_keys``)."""
    keys = module_keys(lm, [name + ".weight" for name in checkpoint_scales])
    return {module: checkpoint_scales[key.removesuffix(".weight")] for module, key in keys.items()}


class _ScalesExpected(logging.Filter):
    """transformers' load report when its only finding is the FP8 checkpoint's ``weight_scale_inv`` tensors, which
    this module reads itself (``read_scales``): not a problem, so not a warning; any other finding stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" not in message:
            return True
        rows = [line for line in message.splitlines() if "|" in line and not line.startswith(("Key", "-"))]
        return not rows or not all(SCALE_SUFFIX in row and "UNEXPECTED" in row for row in rows)


@contextlib.contextmanager
def scales_expected(fp8_checkpoint: bool):
    """Inside the block, transformers' load report of an FP8 checkpoint says nothing of its scales."""
    logger = logging.getLogger("transformers.modeling_utils")
    quiet = _ScalesExpected()
    if fp8_checkpoint:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def apply_compute(lm, *, model: str, compute: str, fp8_checkpoint: bool, device, dtype) -> str:
    """Turn the loaded ``lm`` into ``compute``'s numerics, in place; returns what it computes: ``fp8``,
    ``fp8-emulated`` (the recipe in float32 on the CPU) or ``bf16``. ``device``: a torch.device."""
    from hsextract.model import fp8

    mode = resolve_compute(compute, fp8_checkpoint)
    converted = []
    if fp8_checkpoint:
        scales = scales_by_module(lm, read_scales(model))
        converted = fp8.to_fp8(lm, scales)
    if mode == "bf16":
        if converted:
            fp8.to_dense(lm, dtype)
            log.info("compute bf16: %d fp8 linears of %s dequantized on load", len(converted), model)
        return "bf16"
    if device.type == "cuda" and not fp8.scaled_mm_available(device):
        if compute == "fp8":
            raise HsextractError(
                "--compute fp8 needs block-scaled fp8 GEMMs (a Hopper GPU, compute capability 9.0); this GPU has "
                "none. Leave --compute at auto (an FP8 checkpoint is then dequantized on load)"
            )
        fp8.to_dense(lm, dtype)
        log.warning(
            "compute: this GPU has no block-scaled fp8 GEMMs; the FP8 checkpoint's %d linears were dequantized to %s "
            "on load (states will differ from the FP8-served model's)",
            len(converted),
            dtype,
        )
        return "bf16"
    if not fp8_checkpoint:
        converted = fp8.to_fp8(lm)
    if not converted:
        raise HsextractError(f"--compute fp8: {model} has no linear layer the fp8 recipe converts")
    emulated = device.type != "cuda"
    log.info(
        "compute fp8%s: %d linears in 128x128 blocks",
        " (emulated in float32)" if emulated else "",
        len(converted),
    )
    return "fp8-emulated" if emulated else "fp8"


def write_fp8_checkpoint(lm, out_dir, max_shard_size: str = "10GB") -> list[str]:
    """Save ``lm`` (a bf16 model) in the served FP8 layout under ``out_dir``: every ``fp8.convertible`` linear as
    e4m3 ``weight`` and bf16 ``weight_scale_inv`` (the recipe, dividing by the bf16-rounded scale), the rest as it
    is, and the config's ``quantization_config`` as Qwen3.x-FP8 writes it. Returns the converted linears' names."""
    import torch

    from hsextract.model import fp8

    state = {k: v for k, v in lm.state_dict().items()}
    converted, kept = [], []
    for name, mod in lm.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if fp8.convertible(name, mod):
            q, scale = fp8.quantize_weight(mod.weight.detach(), scale_dtype=torch.bfloat16)
            # held on the host: a model on the GPU keeps its bf16 weights there beside them
            state[f"{name}.weight"] = q.cpu()
            state[f"{name}{SCALE_SUFFIX}"] = scale.to(torch.bfloat16).cpu()
            converted.append(name)
        else:
            kept.append(name)
    if not converted:
        raise HsextractError(
            "no linear of this model fits the fp8 recipe's 128x128 blocks (each dimension a multiple of 128): "
            "there is no served FP8 layout of it to write"
        )
    lm.config.quantization_config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": kept,
    }
    try:
        lm.save_pretrained(out_dir, state_dict=state, max_shard_size=max_shard_size)
    finally:
        del lm.config.quantization_config
    return converted


def run_compute(cfg) -> str:
    """``fp8`` or ``bf16``: what a run's ``--compute`` resolves to for its checkpoint (read from ``config.json``
    alone: the launcher records it before any weight loads)."""
    fp8_checkpoint = not cfg.random_weights and is_fp8_checkpoint(cfg.model_path)
    return resolve_compute(cfg.compute, fp8_checkpoint)
