"""Fused CUDA kernels for the ``qwen3_5`` decoder, swapped into a loaded model in place of transformers' forwards.

    from hsextract.model import qwen3_5 as kernels
    kernels.apply(lm, mode="fused")       # what was swapped: [] on CPU, for "stock", or an unknown architecture
    kernels.restore(lm)                   # transformers' own forwards again (same weights)
    with kernels.stock_forward(lm): ...   # the same for a block: where a dry run's HF reference must run

Module instances are patched (an instance ``forward``, one pre-hook), never transformers' classes, so another model
in the process is untouched. Why: the stock forward spends ~40% of an H200's time outside matrix products; each swap
removes passes over the activations and computes in float32 with one rounding. The swaps, their numerics and what
they need: docs/ARCHITECTURE.md ("The fused forward").
"""

from __future__ import annotations

import contextlib
import logging
import types

from hsextract.config import KERNEL_MODES
from hsextract.errors import HsextractError
from hsextract.model.triton_kernels import _triton_kernels, qk_norm_rope, sigmoid_gate

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


_LIB = None


# The oldest releases these calls were checked against: an older FLA may not know ``use_gate_in_kernel`` and would
# read the raw gate as a log-decay, silently wrong, so it is refused rather than tried.
_MIN_VERSIONS = {"fla-core": "0.6.0", "liger-kernel": "0.8.5"}


def _check_versions() -> None:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    for dist, least in _MIN_VERSIONS.items():
        try:
            have = version(dist)
        except PackageNotFoundError:
            continue  # the import below names what is missing
        if Version(have) < Version(least):
            raise HsextractError(
                f"--kernels fused needs {dist} >= {least}, found {have}: pip install 'hsextract[gpu]' "
                "or run with --kernels stock"
            )


def _libs():
    """flash-linear-attention and liger-kernel entry points; a clear error if either is missing or too old."""
    global _LIB
    if _LIB is not None:
        return _LIB
    _check_versions()
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.modules.fused_norm_gate import rms_norm_gated
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise HsextractError(
            f"--kernels fused needs flash-linear-attention ({e}); install it with pip install 'hsextract[gpu]' "
            "or run with --kernels stock"
        ) from None
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction, LigerSiLUMulFunction
    except ImportError as e:
        raise HsextractError(
            f"--kernels fused needs liger-kernel ({e}); install it with pip install 'hsextract[gpu]' "
            "or run with --kernels stock"
        ) from None
    _LIB = types.SimpleNamespace(
        causal_conv1d=causal_conv1d,
        rms_norm_gated=rms_norm_gated,
        chunk_gated_delta_rule=chunk_gated_delta_rule,
        rms_norm=LigerRMSNormFunction.apply,
        add_rms_norm=LigerFusedAddRMSNormFunction.apply,
        silu_mul=LigerSiLUMulFunction.apply,
        silu_mul_joined=LigerFusedGateUpSiLUMulFunction.apply,
    )
    return _LIB


def rms_norm(norm, x):
    """``Qwen3_5RMSNorm``: x / rms(x) * (1 + w), float32 compute, one rounding."""
    return _libs().rms_norm(x, norm.weight, norm.eps, 1.0, "gemma", False)


def add_rms_norm(x, residual, norm):
    """``s = residual + x`` (bf16, as stock) and ``rms_norm(s)``; returns (normed, s)."""
    return _libs().add_rms_norm(x, residual, norm.weight, norm.eps, 1.0, "gemma", False)


def _rms_norm_forward(self, hidden_states):
    return rms_norm(self, hidden_states)


def _gated_rms_norm_forward(self, hidden_states, gate):
    return _libs().rms_norm_gated(
        hidden_states, gate, self.weight, None, activation="silu", eps=self.variance_epsilon
    )


def _mlp_act(mlp, x):
    joined = _joined(mlp, "_hsx_gate_up", mlp.gate_proj)
    if joined is not None:  # gate and up in one GEMM, SiLU-and-multiply on its two halves
        return _libs().silu_mul_joined(x @ joined.t())
    return _libs().silu_mul(mlp.gate_proj(x), mlp.up_proj(x))


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
    lib = _libs()
    if attention_mask is not None:  # a mask the right-padding hook kept: zero padded inputs, as stock does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    B, T, _ = hidden_states.shape
    kd, hv = self.key_dim, self.num_v_heads
    qkv = self.in_proj_qkv(hidden_states)  # [B, T, 2 kd + vd]; the conv reads its three parts strided
    z = self.in_proj_z(hidden_states)
    joined = _joined(self, "_hsx_ba", self.in_proj_b)
    if joined is not None:  # b and a in one GEMM
        both = hidden_states @ joined.t()
        b, a = both[..., :hv], both[..., hv:]
    else:
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    w = self.conv1d.weight.view(self.conv_dim, -1)
    q = lib.causal_conv1d(qkv[..., :kd], w[:kd], activation="silu")[0]
    k = lib.causal_conv1d(qkv[..., kd : 2 * kd], w[kd : 2 * kd], activation="silu")[0]
    v = lib.causal_conv1d(qkv[..., 2 * kd :], w[2 * kd :], activation="silu")[0]
    o, _ = lib.chunk_gated_delta_rule(
        q.view(B, T, self.num_k_heads, self.head_k_dim),
        k.view(B, T, self.num_k_heads, self.head_k_dim),
        v.view(B, T, hv, self.head_v_dim),
        g=a,
        beta=b,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=self.A_log,
        dt_bias=self.dt_bias,
        use_beta_sigmoid_in_kernel=True,
    )
    o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(o.view(B, T, -1))


def _causal_sdpa(q, k, v, scale):
    """Causal SDPA on grouped k/v through a fused kernel (flash or cuDNN), never the math fallback, which would
    materialise [B, H, T, T] scores; repeats k/v (as stock) only where no fused kernel takes the grouped call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[1] // k.shape[1]
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
    except RuntimeError:
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _attention_forward(
    self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs
):
    if past_key_values is not None:
        return type(self).forward(
            self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
        )
    import torch.nn.functional as F

    B, T, _ = hidden_states.shape
    D = self.head_dim
    qg = self.q_proj(hidden_states).view(B, T, -1, 2 * D)  # per head: query, then its output gate
    k = self.k_proj(hidden_states).view(B, T, -1, D)
    v = self.v_proj(hidden_states).view(B, T, -1, D)
    cos, sin = position_embeddings
    q = qk_norm_rope(qg[..., :D], self.q_norm.weight, cos, sin, self.q_norm.eps)
    k = qk_norm_rope(k, self.k_norm.weight, cos, sin, self.k_norm.eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D] views, no copies
    if attention_mask is None and T > 1:
        out = _causal_sdpa(q, k, v, self.scaling)
    else:  # a mask the right-padding hook kept: as stock (k/v repeated, masked kernel)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None and T > 1, scale=self.scaling
        )
    out = sigmoid_gate(out.transpose(1, 2), qg[..., D:])
    return self.o_proj(out), None


def _decoder_layer_forward(
    self,
    hidden_states,
    position_embeddings,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    **kwargs,
):
    if past_key_values is not None:
        return type(self).forward(
            self, hidden_states, position_embeddings, attention_mask, position_ids, past_key_values, **kwargs
        )
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


def _layer_forward(layer):
    """The fused layer forward: the fp8 one where the layer's linears are ``Fp8Linear`` (qwen3_5_fp8.py; None
    where it cannot run them: the layer keeps its stock forward over the swapped modules), else the bf16 one."""
    from hsextract.model import fp8, qwen3_5_fp8

    if not any(isinstance(mod, fp8.Fp8Linear) for mod in layer.modules()):
        return _decoder_layer_forward
    ops = types.SimpleNamespace(lib=_libs(), joined=_joined, causal_sdpa=_causal_sdpa)
    return qwen3_5_fp8.layer_forward(layer, ops)


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


def _join(owner, first, second, attr: str):
    """One [n1 + n2, in] tensor holding two projections' weights, which become views of it, so that both run as one
    GEMM; kept on ``owner`` as ``attr``, and reused by a later ``apply`` while the weights are still its views.
    None (the two GEMMs stay) unless both are plain bias-free ``nn.Linear`` layers."""
    import torch

    if not all(type(p) is torch.nn.Linear and p.bias is None for p in (first, second)):
        return None
    w1, w2 = first.weight, second.weight
    joined = getattr(owner, attr, None)
    n = w1.shape[0]
    if joined is not None and w1.data_ptr() == joined.data_ptr() and w2.data_ptr() == joined[n:].data_ptr():
        return joined
    joined = torch.cat([w1.detach(), w2.detach()])
    first.weight = torch.nn.Parameter(joined[:n], requires_grad=False)
    second.weight = torch.nn.Parameter(joined[n:], requires_grad=False)
    return joined


def _joined(owner, attr: str, first):
    """``owner``'s joined weight when ``first`` (its first projection) still is a view of it, else None."""
    joined = getattr(owner, attr, None)
    if joined is not None and joined.data_ptr() == first.weight.data_ptr():
        return joined
    return None


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
    _libs()
    _triton_kernels()
    swapped: set = set()
    for mod in lm.modules():
        if isinstance(mod, m.Qwen3_5RMSNorm):
            _patch(mod, _rms_norm_forward, "rms_norm", swapped)
        elif isinstance(mod, m.Qwen3_5RMSNormGated):
            _patch(mod, _gated_rms_norm_forward, "gated_rms_norm", swapped)
        elif isinstance(mod, m.Qwen3_5MLP) and getattr(mod.config, "hidden_act", "silu") in ("silu", "swish"):
            mod._hsx_gate_up = _join(mod, mod.gate_proj, mod.up_proj, "_hsx_gate_up")
            _patch(mod, _mlp_forward, "silu_mul", swapped)
        elif isinstance(mod, m.Qwen3_5GatedDeltaNet) and mod.activation in ("silu", "swish"):
            mod._hsx_ba = _join(mod, mod.in_proj_b, mod.in_proj_a, "_hsx_ba")
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
