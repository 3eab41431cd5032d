"""Forward hooks with early exit, and the on-device gather of valid tokens.

The forward runs on the bare decoder stack; a hook on each wanted layer gathers its valid (unpadded) tokens
straight into one buffer laid out as the batch file stores it, and the deepest wanted layer's hook raises
``_StopForward``, so later layers, the final norm and the lm_head never run. With fp8 storage the hooks quantize
what they gather; with ``--target-topk`` the last layer's hook computes the top-k (target_topk.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hsextract.errors import HsextractError
from hsextract.model import qwen3_5 as kernels
from hsextract.model.load import base_model, decoder_layers, final_norm, output_embeddings
from hsextract.model.target_topk import logits_chunk_tokens, target_topk_
from hsextract.output import FinalNorm, quantize_fp8_

log = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised by the deepest hook: nothing after the last wanted layer needs to run."""


@dataclass
class GatherTarget:
    """Where the hooks of one batch write: ``out[t, j, :]`` = layer ``layer_ids[j]`` at valid token ``t``."""

    flat_index: object  # LongTensor [tokens] into the [rows * padded_length] positions
    out: object  # Tensor [tokens, len(layer_ids), hidden]; float8_e4m3fn when ``scale`` is given
    scale: object = None  # float32 Tensor [tokens, len(layer_ids)]: fp8 storage, a scale per token per slot
    topk_ids: object = None  # int32 Tensor [tokens, K]: the target's top-k (``target_topk``), else None
    topk_logprobs: object = None  # float32 Tensor [tokens, K]


class LayerCapture:
    """Forward hooks that gather the wanted layers' valid tokens and stop the forward after the deepest one.

    Use as ``with LayerCapture(lm, layer_ids) as cap: cap.forward(input_ids, attention_mask, target)``.
    With ``target_topk`` the forward runs to the last layer, whose hook also fills the target's top-k.
    """

    def __init__(self, lm, layer_ids: tuple[int, ...], target_topk: int | None = None):
        self.lm = lm
        self.layer_ids = tuple(layer_ids)
        self.decoder = base_model(lm)
        self.layers = decoder_layers(lm)
        self.target_topk = target_topk
        last = len(self.layers) - 1
        self.deepest = last if target_topk else max(self.layer_ids)
        if target_topk:
            self.norm, self.lm_head = final_norm(lm), output_embeddings(lm)
            self.chunk_tokens = logits_chunk_tokens(self.lm_head.weight.shape[0])
        self._target: GatherTarget | None = None
        self._handles = []

    def __enter__(self):
        slots = {k: j for j, k in enumerate(self.layer_ids)}
        hooked = sorted(set(self.layer_ids) | ({self.deepest} if self.target_topk else set()))
        for k in hooked:
            self._handles.append(self.layers[k].register_forward_hook(self._make_hook(slots.get(k), k)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, j: int | None, k: int):
        """The hook of layer ``k``: its valid tokens into slot ``j`` (None: no slot), the target's top-k on the
        last layer when asked for, and the stop after the deepest."""
        topk = self.target_topk and k == self.deepest

        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            target = self._target
            flat = hidden.reshape(-1, hidden.shape[-1])
            rows = flat.index_select(0, target.flat_index)
            if j is not None and target.scale is None:
                target.out[:, j].copy_(rows)
            elif j is not None:
                quantize_fp8_(rows, target.out[:, j], target.scale[:, j])
            if topk:
                # The valid tokens only, normed by the model's own norm module: HF's last hidden state.
                target_topk_(
                    self.norm(rows),
                    self.lm_head,
                    target.topk_ids,
                    target.topk_logprobs,
                    chunk_tokens=self.chunk_tokens,
                )
            if k == self.deepest:
                raise _StopForward

        return hook

    def forward(
        self, input_ids, attention_mask, target: GatherTarget, *, cache=None, position_ids=None
    ) -> None:
        """Run the decoder on one padded batch; the hooks fill ``target.out``. With ``cache`` (transformers'
        ``DynamicCache``, updated in place up to the deepest hooked layer) the tokens continue what it holds, at
        ``position_ids`` (prefix.py)."""
        self._target = target
        try:
            self.decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=cache is not None,
                past_key_values=cache,
                position_ids=position_ids,
            )
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
    for rule in FinalNorm.RULES:
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
