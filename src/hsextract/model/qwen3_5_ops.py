"""The ``qwen3_5`` decoder's fused operations shared by its bf16 (qwen3_5.py) and fp8 (qwen3_5_fp8.py) layers:
the FLA and Liger entry points, the norms, the Gated-DeltaNet's mixing and the attention between their projections.
"""

from __future__ import annotations

import types

from hsextract.errors import HsextractError
from hsextract.model.triton_kernels import qk_norm_rope

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


def libs():
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
    return libs().rms_norm(x, norm.weight, norm.eps, 1.0, "gemma", False)


def add_rms_norm(x, residual, norm):
    """``s = residual + x`` (bf16, as stock) and ``rms_norm(s)``; returns (normed, s)."""
    return libs().add_rms_norm(x, residual, norm.weight, norm.eps, 1.0, "gemma", False)


def join_weights(owner, first, second, attr: str):
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


def joined_weight(owner, attr: str, first):
    """``owner``'s joined weight when ``first`` (its first projection) still is a view of it, else None."""
    joined = getattr(owner, attr, None)
    if joined is not None and joined.data_ptr() == first.weight.data_ptr():
        return joined
    return None


def causal_sdpa(q, k, v, scale):
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


def attend(attn, qg, k, v, position_embeddings, attention_mask):
    """The attention between its projections: ``qg`` [B, T, H, 2D] (per head the query, then its output gate),
    ``k``, ``v`` [B, T, Hkv, D]; QK-norm and RoPE, then causal attention; returns [B, T, H, D], before the gate."""
    import torch.nn.functional as F

    D = attn.head_dim
    cos, sin = position_embeddings
    q = qk_norm_rope(qg[..., :D], attn.q_norm.weight, cos, sin, attn.q_norm.eps)
    k = qk_norm_rope(k, attn.k_norm.weight, cos, sin, attn.k_norm.eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D] views, no copies
    if attention_mask is None and q.shape[2] > 1:
        out = causal_sdpa(q, k, v, attn.scaling)
    else:  # a mask the right-padding hook kept: as stock (k/v repeated, masked kernel)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None and q.shape[2] > 1,
            scale=attn.scaling,
        )  # fmt: skip
    return out.transpose(1, 2)


def delta_rule(gdn, qkv, x):
    """The Gated-DeltaNet's mixing after its qkv projection: ``qkv`` [B, T, conv_dim] through the causal conv and
    the chunked gated delta rule, its b and a read from ``x`` (the layer's normed input, bf16 linears in both
    numerics); returns the per-head output [B, T, Hv, Dv], before the gated norm."""
    lib = libs()
    B, T, _ = qkv.shape
    kd, hv = gdn.key_dim, gdn.num_v_heads
    joined = joined_weight(gdn, "_hsx_ba", gdn.in_proj_b)
    if joined is not None:  # b and a in one GEMM
        both = x @ joined.t()
        b, a = both[..., :hv], both[..., hv:]
    else:
        b, a = gdn.in_proj_b(x), gdn.in_proj_a(x)
    w = gdn.conv1d.weight.view(gdn.conv_dim, -1)  # the conv reads qkv's three parts strided
    q = lib.causal_conv1d(qkv[..., :kd], w[:kd], activation="silu")[0]
    k = lib.causal_conv1d(qkv[..., kd : 2 * kd], w[kd : 2 * kd], activation="silu")[0]
    v = lib.causal_conv1d(qkv[..., 2 * kd :], w[2 * kd :], activation="silu")[0]
    o, _ = lib.chunk_gated_delta_rule(
        q.view(B, T, gdn.num_k_heads, gdn.head_k_dim),
        k.view(B, T, gdn.num_k_heads, gdn.head_k_dim),
        v.view(B, T, hv, gdn.head_v_dim),
        g=a,
        beta=b,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=gdn.A_log,
        dt_bias=gdn.dt_bias,
        use_beta_sigmoid_in_kernel=True,
    )
    return o
