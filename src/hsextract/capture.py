"""Layer ids, model loading, forward hooks with early exit, and the on-device gather of valid tokens.

One convention, everywhere in hsextract: layer id ``k`` is the OUTPUT of decoder layer ``k`` (0-based), before
the final norm. That is DFlash's, SpecForge's and ModelOpt's convention, and equals HF
``output_hidden_states[k + 1]`` (index 0 is the embedding output) for every layer but the last, whose HF entry has
the final norm applied. vLLM/speculators count the INPUT of layer ``k``: their id is ours plus one. Ids are checked
against the model config before any weight is loaded.

The forward runs on the bare decoder stack (no lm_head). A hook on each wanted layer gathers the valid (unpadded)
tokens of its output straight into one preallocated buffer laid out as the batch file stores it,
``[tokens, slots, hidden]``; the hook on the deepest wanted layer then raises ``_StopForward``, so later layers,
the final norm and the lm_head never run. The final state (``--final-state``) is one more wanted layer, the last
one: its slot holds the raw output, before the final norm. With fp8 storage the hooks quantize what they gather
(states.py), so the buffer holds fp8 values and a float32 scale per token per slot.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import HsextractError, load_or_explain

log = logging.getLogger(__name__)

PRESETS = ("dflash", "eagle3")


def dflash_layer_ids(num_layers: int, num_targets: int = 5) -> tuple[int, ...]:
    """DFlash's default: ``num_targets`` ids evenly spaced from 1 to N-3, rounded ([1, 16, 31, 46, 61] for 64)."""
    start, end = 1, num_layers - 3
    if num_targets == 1 or end <= start:
        return (start,)
    ids = [round(start + i * (end - start) / (num_targets - 1)) for i in range(num_targets)]
    return tuple(sorted(set(ids)))


def eagle3_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default in the output convention: low, middle and high layers."""
    return tuple(sorted({1, num_layers // 2 - 1, num_layers - 4}))


def parse_layers(spec) -> tuple[int, ...] | str:
    """``"dflash"``, ``"eagle3"``, ``"1,16,31"`` or a sequence of ints."""
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s in PRESETS:
            return s
        try:
            return tuple(int(x) for x in s.replace(" ", "").split(",") if x)
        except ValueError:
            raise HsextractError(
                f"--layers {spec!r} is neither a preset ({', '.join(PRESETS)}) nor comma-separated integers"
            ) from None
    return tuple(int(x) for x in spec)


def resolve_layer_ids(spec, num_layers: int) -> tuple[int, ...]:
    """Concrete, sorted, checked layer ids for a model with ``num_layers`` decoder layers."""
    spec = parse_layers(spec)
    if spec == "dflash":
        ids = dflash_layer_ids(num_layers)
    elif spec == "eagle3":
        ids = eagle3_layer_ids(num_layers)
    else:
        ids = spec
    if not ids:
        raise HsextractError("--layers is empty: name at least one decoder layer id")
    if len(set(ids)) != len(ids):
        raise HsextractError(f"--layers {list(ids)} repeats an id")
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise HsextractError(
            f"layer id(s) {bad} out of range: the model has {num_layers} decoder layers, ids 0..{num_layers - 1} "
            f"(id k = OUTPUT of decoder layer k = HF output_hidden_states[k+1]; vLLM-style 'input of layer k' "
            f"ids are one higher)"
        )
    return tuple(sorted(ids))


def describe_layer(k: int, num_layers: int) -> dict:
    """What id ``k`` means in each convention users meet."""
    return {
        "layer_id": k,
        "captures": f"output of decoder layer {k} (pre-final-norm)",
        "hf_output_hidden_states_index": k + 1,
        "hf_index_matches_exactly": k + 1 < num_layers,  # HF's last entry has the final norm applied
        "vllm_input_of_layer_id": k + 1,
    }


def load_model_config(model: str):
    """The model's config (no weights), its text config and layer count; a clear error if the path is wrong."""
    from transformers import AutoConfig

    if os.path.sep in model or model.startswith(".") or Path(model).exists():
        if not Path(model).exists():
            raise HsextractError(f"--model {model}: no such directory")
        if Path(model).is_dir() and not (Path(model) / "config.json").exists():
            raise HsextractError(
                f"--model {model}: directory has no config.json (is it a transformers checkpoint?)"
            )
    config = load_or_explain(model, "read its config", lambda: AutoConfig.from_pretrained(model))
    text = config.get_text_config()
    num_layers = getattr(text, "num_hidden_layers", None)
    if not num_layers:
        raise HsextractError(f"--model {model}: config has no num_hidden_layers; is it a decoder LM?")
    return config, text, num_layers


def layer_types(text_config) -> list[str]:
    types = getattr(text_config, "layer_types", None)
    return list(types) if types else ["full_attention"] * text_config.num_hidden_layers


def load_model(
    model: str, *, dtype: str, device: str, attn_implementation: str = "sdpa", random_weights=False
):
    """The causal LM in eval mode on ``device``. For a multimodal checkpoint (e.g. Qwen3_5ForConditionalGeneration)
    transformers maps AutoModelForCausalLM to the text-only class and skips the vision tower's weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if random_weights:
        config = AutoConfig.from_pretrained(model).get_text_config()
        config._attn_implementation = attn_implementation
        with torch.device(device):
            lm = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        # device_map loads the weights straight onto the GPU, never staging 54 GB in host memory first.
        placement = {} if device == "cpu" else {"device_map": {"": device}}
        lm = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch_dtype, attn_implementation=attn_implementation, **placement
        )
    lm.eval()
    lm.requires_grad_(False)
    return lm


def load_model_for(cfg, device) -> object:
    """The model a run's config names, on ``device`` (a torch.device), with the run's kernels swapped in
    (kernels.py): what the worker and dry-run load."""
    from . import kernels

    lm = load_model(
        cfg.model,
        dtype=cfg.dtype,
        device=str(device),
        attn_implementation=cfg.attn_implementation,
        random_weights=cfg.random_weights,
    )
    swapped = kernels.apply(lm, cfg.kernel_mode)
    log.info("kernels: %s (%s)", cfg.kernel_mode, ", ".join(swapped) or "none swapped")
    return lm


def torch_device(cfg):
    """``cuda:0`` (each worker sees only its own GPU) or ``cpu``."""
    import torch

    return torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")


def decoder_layers(lm):
    """The ModuleList of decoder layers, wherever the architecture keeps it."""
    import torch.nn as nn

    n = lm.config.get_text_config().num_hidden_layers
    candidates = [
        (name, mod)
        for name, mod in lm.named_modules()
        if isinstance(mod, nn.ModuleList)
        and len(mod) == n
        and name.split(".")[-1] in ("layers", "h", "blocks")
    ]
    if not candidates:
        raise HsextractError(f"could not find the {n} decoder layers of {type(lm).__name__}")
    return min(candidates, key=lambda c: c[0].count("."))[1]


def base_model(lm):
    """The decoder stack without the lm_head (its forward returns hidden states only)."""
    return lm.get_decoder() if hasattr(lm, "get_decoder") and lm.get_decoder() is not None else lm.base_model


def final_norm(lm):
    """The norm the decoder applies after its last layer (what HF's last ``output_hidden_states`` entry has)."""
    decoder = base_model(lm)
    for name in ("norm", "final_layernorm", "ln_f"):
        if getattr(decoder, name, None) is not None:
            return getattr(decoder, name)
    raise HsextractError(
        f"could not find the final norm of {type(lm).__name__} (looked for norm, final_layernorm, ln_f)"
    )


class _StopForward(Exception):
    """Raised by the deepest hook: nothing after the last wanted layer needs to run."""


@dataclass
class GatherTarget:
    """Where the hooks of one batch write: ``out[t, j, :]`` = layer ``layer_ids[j]`` at valid token ``t``."""

    flat_index: object  # LongTensor [tokens] into the [rows * padded_length] positions
    out: object  # Tensor [tokens, len(layer_ids), hidden]; float8_e4m3fn when ``scale`` is given
    scale: object = None  # float32 Tensor [tokens, len(layer_ids)]: fp8 storage, a scale per token per slot


class LayerCapture:
    """Forward hooks that gather the wanted layers' valid tokens and stop the forward after the deepest one.

    Use as ``with LayerCapture(lm, layer_ids) as cap: cap.forward(input_ids, attention_mask, target)``.
    """

    def __init__(self, lm, layer_ids: tuple[int, ...], shift: int = 0):
        # ``shift`` exists only so the dry run's tests can prove a shifted capture is caught; never set it otherwise.
        self.lm = lm
        self.layer_ids = tuple(layer_ids)
        self.decoder = base_model(lm)
        self.layers = decoder_layers(lm)
        self.deepest = max(self.layer_ids) + shift
        self._shift = shift
        self._target: GatherTarget | None = None
        self._handles = []

    def __enter__(self):
        for j, k in enumerate(self.layer_ids):
            self._handles.append(
                self.layers[k + self._shift].register_forward_hook(self._make_hook(j, k + self._shift))
            )
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, j: int, k: int):
        from .states import quantize_fp8_  # torch; this module is imported by torch-free preparation too

        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            target = self._target
            flat = hidden.reshape(-1, hidden.shape[-1])
            rows = flat.index_select(0, target.flat_index)
            if target.scale is None:
                target.out[:, j].copy_(rows)
            else:
                quantize_fp8_(rows, target.out[:, j], target.scale[:, j])
            if k == self.deepest:
                raise _StopForward

        return hook

    def forward(self, input_ids, attention_mask, target: GatherTarget) -> None:
        """Run the decoder on one padded batch; the hooks fill ``target.out``."""
        self._target = target
        try:
            self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        else:
            raise RuntimeError("the forward finished without reaching the deepest wanted layer")
        finally:
            self._target = None
