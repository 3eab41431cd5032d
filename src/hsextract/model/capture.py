"""Forward hooks with early exit, and the on-device gather of valid tokens.

Layer id ``k`` is the output of decoder layer ``k`` before the final norm (layers.py). The forward runs on the bare
decoder stack (no lm_head); a hook on each wanted layer gathers the valid (unpadded) tokens of its output straight
into one preallocated buffer laid out as the batch file stores it, ``[tokens, slots, hidden]``, and the hook on the
deepest wanted layer raises ``_StopForward``, so later layers, the final norm and the lm_head never run. The final
state is the last layer's slot, before the norm; with fp8 storage the hooks quantize what they gather (format/fp8.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hsextract.errors import HsextractError
from hsextract.format.final_norm import RULES, FinalNorm
from hsextract.format.fp8 import quantize_fp8_
from hsextract.model import qwen3_5 as kernels
from hsextract.model.load import base_model, decoder_layers, final_norm

log = logging.getLogger(__name__)


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

    def __init__(self, lm, layer_ids: tuple[int, ...]):
        self.lm = lm
        self.layer_ids = tuple(layer_ids)
        self.decoder = base_model(lm)
        self.layers = decoder_layers(lm)
        self.deepest = max(self.layer_ids)
        self._target: GatherTarget | None = None
        self._handles = []

    def __enter__(self):
        for j, k in enumerate(self.layer_ids):
            self._handles.append(self.layers[k].register_forward_hook(self._make_hook(j, k)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, j: int, k: int):
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


def probe_final_norm(norm) -> FinalNorm:
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
        got = FinalNorm(weight=weight, eps=float(eps), rule=rule)(probe).float()
        errors[rule] = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    rule = min(errors, key=errors.get)
    tolerance = 1e-5 if weight.dtype == torch.float32 else 1e-2
    if errors[rule] > tolerance:
        raise HsextractError(
            f"--final-state: the model's final norm ({name}) follows neither RMSNorm rule hsextract knows "
            f"(relative difference {errors}); its normed state cannot be derived from the stored one"
        )
    return FinalNorm(weight=weight.cpu().clone(), eps=float(eps), rule=rule)


def model_final_norm(lm) -> FinalNorm:
    """The final norm of a loaded model as transformers defines it: probed with transformers' own forwards in
    place, should fused kernels (qwen3_5.py) be swapped in."""
    with kernels.stock_forward(lm):
        return probe_final_norm(final_norm(lm))
