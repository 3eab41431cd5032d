"""Fused CUDA kernels for the ``qwen3_5`` decoder, swapped into a loaded model in place of transformers' forwards:
``apply(lm, mode="fused")`` (what was swapped; [] on CPU, for "stock" or another architecture), ``restore(lm)``,
``with stock_forward(lm):`` (where a dry run's HF reference runs). Module instances are patched, never transformers'
classes, so another model in the process is untouched. Each swap removes passes over the activations and computes in
float32 with one rounding; the swaps, their numerics and what they need: docs/ARCHITECTURE.md ("The fused forward").
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

from hsextract.config import KERNEL_MODES
from hsextract.errors import HsextractError
from hsextract.model.qwen3_5_ops import (
    add_rms_norm,
    attend,
    delta_rule,
    join_weights,
    joined_weight,
    libs,
    rms_norm,
)
from hsextract.model.triton_kernels import _triton_kernels, sigmoid_gate

log = logging.getLogger(__name__)


MODES = KERNEL_MODES


_TAG = "_hsx_kernels"  # attribute on a patched module: the names of what was swapped on it


# Names returned by ``apply``, in the order of the module docstring.
SWAPS = (
    "rms_norm",
    "residual_add_rms_norm",
    "silu_mul",
    "causal_conv1d",
    "gated_delta_rule",
    "gated_rms_norm",
    "attention",
    "right_padding",
)


def _rms_norm_forward(self, hidden_states):
    return rms_norm(self, hidden_states)


def _gated_rms_norm_forward(self, hidden_states, gate):
    return libs().rms_norm_gated(
        hidden_states, gate, self.weight, None, activation="silu", eps=self.variance_epsilon
    )


def _mlp_act(mlp, x):
    joined = joined_weight(mlp, "_hsx_gate_up", mlp.gate_proj)
    if joined is not None:  # gate and up in one GEMM, SiLU-and-multiply on its two halves
        return libs().silu_mul_joined(x @ joined.t())
    return libs().silu_mul(mlp.gate_proj(x), mlp.up_proj(x))


def _mlp_forward(self, x):
    return self.down_proj(_mlp_act(self, x))


def _mlp_residual(mlp, x, residual):
    """``residual + mlp(x)`` with the add inside the down projection's GEMM; ``residual`` is overwritten."""
    act = _mlp_act(mlp, x)
    flat = residual.view(-1, residual.shape[-1])
    flat.addmm_(act.view(-1, act.shape[-1]), mlp.down_proj.weight.t())
    return residual


def _gdn_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    if cache_params is not None:
        return type(self).forward(self, hidden_states, cache_params, attention_mask, **kwargs)
    if attention_mask is not None:  # a mask the right-padding hook kept: zero padded inputs, as stock does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    B, T, _ = hidden_states.shape
    o = delta_rule(self, self.in_proj_qkv(hidden_states), hidden_states)
    z = self.in_proj_z(hidden_states)
    o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(o.view(B, T, -1))


def _attention_forward(
    self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs
):
    if past_key_values is not None:
        return type(self).forward(
            self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
        )
    B, T, _ = hidden_states.shape
    D = self.head_dim
    qg = self.q_proj(hidden_states).view(B, T, -1, 2 * D)
    k = self.k_proj(hidden_states).view(B, T, -1, D)
    v = self.v_proj(hidden_states).view(B, T, -1, D)
    out = attend(self, qg, k, v, position_embeddings, attention_mask)
    return self.o_proj(sigmoid_gate(out, qg[..., D:])), None


def _decoder_layer_forward(
    self, hidden_states, position_embeddings, attention_mask=None, position_ids=None, **kwargs
):
    h = self.input_layernorm(hidden_states)
    if self.block_type == "linear_attention":
        h = self.linear_attn(hidden_states=h, cache_params=None, attention_mask=attention_mask, **kwargs)
    else:
        h, _ = self.self_attn(
            hidden_states=h,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=None,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    h, residual = add_rms_norm(h, hidden_states, self.post_attention_layernorm)
    return _mlp_residual(self.mlp, h, residual)


def _prefill_only(fused):
    """A fused decoder-layer forward for whole sequences; with a KV cache (generation) transformers' own runs."""

    @functools.wraps(fused)
    def forward(self, hidden_states, position_embeddings, attention_mask=None, position_ids=None,
                past_key_values=None, **kwargs):  # fmt: skip
        if past_key_values is not None:
            return type(self).forward(
                self,
                hidden_states,
                position_embeddings,
                attention_mask,
                position_ids,
                past_key_values,
                **kwargs,
            )
        return fused(self, hidden_states, position_embeddings, attention_mask, position_ids, **kwargs)

    return forward


def _layer_forward(layer):
    """The fused layer forward: the fp8 one where the layer's linears are ``Fp8Linear`` (qwen3_5_fp8.py; None
    where it cannot run them: the layer keeps its stock forward over the swapped modules), else the bf16 one."""
    from hsextract.model import fp8, qwen3_5_fp8

    if not any(isinstance(mod, fp8.Fp8Linear) for mod in layer.modules()):
        return _prefill_only(_decoder_layer_forward)
    fused = qwen3_5_fp8.layer_forward(layer)
    return _prefill_only(fused) if fused else None


def is_right_padded(mask) -> bool:
    """True when every row of a 2-D 0/1 mask is ones then zeros (no padding at all included)."""
    m = mask.to(bool)
    return not bool((m[:, 1:] & ~m[:, :-1]).any())


def _drop_right_padding_mask(module, args, kwargs):
    mask = kwargs.get("attention_mask")
    positional = mask is None and len(args) > 1
    if positional:
        mask = args[1]
    if mask is None or getattr(mask, "ndim", 0) != 2 or not is_right_padded(mask):
        return None
    if positional:
        args = (args[0], None, *args[2:])
    else:
        kwargs = dict(kwargs, attention_mask=None)
    return args, kwargs


def _qwen3_5_classes():
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    except ImportError:
        return None
    return m


def _is_cuda(lm) -> bool:
    p = next(lm.parameters(), None)
    return p is not None and p.device.type == "cuda"


def _patch(module, forward, name: str, swapped: set) -> None:
    module.forward = types.MethodType(forward, module)
    setattr(module, _TAG, name)
    swapped.add(name)


FLA_MAX_KEY_HEAD_DIM = 256

"""FLA's chunked delta rule keeps a key head in one tile (fla/ops/common/chunk_delta_h.py asserts K <= 256)."""


def claims(text_config) -> bool:
    """True for the configs ``apply`` swaps kernels into: transformers' ``qwen3_5`` (and its text part)."""
    return getattr(text_config, "model_type", None) in ("qwen3_5_text", "qwen3_5")


def unsupported(text_config) -> list[str]:
    """What of a ``qwen3_5`` config's shape the fused kernels cannot run, each with its value; [] when they can.
    Layer pattern, depth, head counts, RoPE type and scaling (cos/sin come from transformers), MTP layers and tied
    embeddings are free; what is checked is what a kernel fixes at compile time."""
    t = text_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    rope = getattr(t, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(t, "partial_rotary_factor", 1.0))
    rotary = int(head_dim * factor)
    hk, hv = t.linear_num_key_heads, t.linear_num_value_heads
    problems = []
    if head_dim & (head_dim - 1):
        problems.append(
            f"head_dim {head_dim} is not a power of two (the QK-norm + RoPE and gate kernels need one)"
        )
    if rotary % 2 or rotary > head_dim:
        problems.append(
            f"rotary dims {rotary} (head_dim x partial_rotary_factor {factor}) are not even and <= head_dim"
        )
    if t.num_attention_heads % t.num_key_value_heads:
        problems.append(
            f"num_attention_heads {t.num_attention_heads} is not a multiple of num_key_value_heads "
            f"{t.num_key_value_heads}"
        )
    if hv % hk:
        problems.append(f"linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}")
    if t.linear_key_head_dim > FLA_MAX_KEY_HEAD_DIM:
        problems.append(f"linear_key_head_dim {t.linear_key_head_dim} is over FLA's {FLA_MAX_KEY_HEAD_DIM}")
    return problems


def check_shape(text_config) -> None:
    """Refuse, before any weight is read, a ``qwen3_5`` shape the fused kernels cannot run."""
    problems = unsupported(text_config) if claims(text_config) else []
    if problems:
        raise HsextractError(
            "--kernels fused cannot run this qwen3_5 model: "
            + "; ".join(problems)
            + ". Run with --kernels stock"
        )


def apply(lm, mode: str = "fused") -> list[str]:
    """Swap the fused kernels into ``lm`` (see the module docstring); returns the names of what was swapped, in
    ``SWAPS`` order. ``mode="stock"`` restores transformers' forwards and returns []. A model on the CPU, or of an
    architecture other than ``qwen3_5``, is left as it is and [] returned; a ``qwen3_5`` shape the kernels cannot
    run (``unsupported``) is an error."""
    if mode not in MODES:
        raise HsextractError(f"--kernels {mode!r}: choose one of {', '.join(MODES)}")
    restore(lm)
    if mode == "stock" or not _is_cuda(lm):
        return []
    m = _qwen3_5_classes()
    text = lm.config.get_text_config()
    if m is None or not claims(text):
        log.info(
            "kernels: no fused kernels for model_type %s; stock forward", getattr(text, "model_type", None)
        )
        return []
    check_shape(text)
    libs()
    _triton_kernels()
    swapped: set = set()
    for mod in lm.modules():
        if isinstance(mod, m.Qwen3_5RMSNorm):
            _patch(mod, _rms_norm_forward, "rms_norm", swapped)
        elif isinstance(mod, m.Qwen3_5RMSNormGated):
            _patch(mod, _gated_rms_norm_forward, "gated_rms_norm", swapped)
        elif isinstance(mod, m.Qwen3_5MLP) and getattr(mod.config, "hidden_act", "silu") in ("silu", "swish"):
            mod._hsx_gate_up = join_weights(mod, mod.gate_proj, mod.up_proj, "_hsx_gate_up")
            _patch(mod, _mlp_forward, "silu_mul", swapped)
        elif isinstance(mod, m.Qwen3_5GatedDeltaNet) and mod.activation in ("silu", "swish"):
            mod._hsx_ba = join_weights(mod, mod.in_proj_b, mod.in_proj_a, "_hsx_ba")
            _patch(mod, _gdn_forward, "gated_delta_rule", swapped)
            swapped.add("causal_conv1d")
        elif isinstance(mod, m.Qwen3_5Attention):
            _patch(mod, _attention_forward, "attention", swapped)
    for mod in lm.modules():
        if isinstance(mod, m.Qwen3_5DecoderLayer) and {"rms_norm", "silu_mul"} <= swapped:
            if forward := _layer_forward(mod):
                _patch(mod, forward, "residual_add_rms_norm", swapped)
        elif isinstance(mod, m.Qwen3_5TextModel):
            handle = mod.register_forward_pre_hook(_drop_right_padding_mask, with_kwargs=True)
            mod._hsx_mask_hook = handle
            setattr(mod, _TAG, "right_padding")
            swapped.add("right_padding")
    import torch

    torch.cuda.empty_cache()  # the separate weights the joins replaced, back to the driver
    return [name for name in SWAPS if name in swapped]


def restore(lm) -> None:
    """Undo ``apply``: transformers' own forwards and no padding hook. Joined weights stay joined (views of one
    tensor, which the stock forwards use unchanged)."""
    for mod in lm.modules():
        if getattr(mod, _TAG, None) is None:
            continue
        mod.__dict__.pop("forward", None)
        handle = mod.__dict__.pop("_hsx_mask_hook", None)
        if handle is not None:
            handle.remove()
        delattr(mod, _TAG)


def swapped(lm) -> list[str]:
    """What ``apply`` swapped into ``lm`` and is still in place."""
    names = {getattr(mod, _TAG, None) for mod in lm.modules()}
    if "gated_delta_rule" in names:
        names.add("causal_conv1d")
    return [name for name in SWAPS if name in names]


@contextlib.contextmanager
def stock_forward(lm):
    """Run ``lm`` with transformers' forwards inside the block, then put the swapped kernels back."""
    names = swapped(lm)
    restore(lm)
    try:
        yield lm
    finally:
        if names:
            apply(lm, "fused")
