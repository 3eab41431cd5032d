"""The fused ``qwen3_5`` decoder layer when its linears are ``Fp8Linear`` (``--compute fp8``, fp8.py).

qwen3_5.py's fused forward, with each activation a linear reads quantized by the kernel that produces it
(fp8_kernels.py), and the linears that read one activation joined into one block-scaled GEMM (gate and up; qkv and
z; q, k and v), whose weights and tile scales the modules keep views of, so that the stock forward still runs.
"""

from __future__ import annotations

import torch

from hsextract.model import fp8_kernels as fk
from hsextract.model.fp8 import Fp8Activation, Fp8Linear
from hsextract.model.qwen3_5_ops import attend, delta_rule


def join(owner, attr: str, *parts) -> Fp8Linear | None:
    """One ``Fp8Linear`` computing ``parts`` (bias-free ``Fp8Linear`` layers of one input, each a multiple of 128
    outputs) at once, kept on ``owner`` as ``attr``; the parts' weights and scales become views of it. None when
    they cannot be joined (their GEMMs then stay separate)."""
    if not all(isinstance(p, Fp8Linear) and p.bias is None and p.out_features % 128 == 0 for p in parts):
        return None
    if len({p.in_features for p in parts}) != 1:
        return None
    joined = getattr(owner, attr, None)
    if joined is not None and parts[0].weight.data_ptr() == joined.weight.data_ptr():
        return joined
    joined = Fp8Linear(
        torch.cat([p.weight.detach() for p in parts]), torch.cat([p.weight_scale_inv for p in parts])
    )
    row = 0
    for p in parts:
        n = p.out_features
        p.weight = torch.nn.Parameter(joined.weight[row : row + n], requires_grad=False)
        p.weight_scale_inv = joined.weight_scale_inv[row // 128 : (row + n) // 128]
        row += n
    joined.joins = len(parts)
    setattr(owner, attr, joined)
    return joined


def layer_forward(layer):
    """The fp8 decoder-layer forward for ``layer`` (its joins made), or None when its linears are not all
    ``Fp8Linear`` on a GPU with block-scaled GEMMs, or a shape the fused kernels cannot take (the bf16 fused
    forward is used then, its linears quantizing their own inputs)."""
    mlp = layer.mlp
    mixer = layer.linear_attn if layer.block_type == "linear_attention" else layer.self_attn
    if not isinstance(mlp.down_proj, Fp8Linear) or not mlp.down_proj.gemm_ready:
        return None
    if join(mlp, "_hsx_fp8_gate_up", mlp.gate_proj, mlp.up_proj) is None:
        return None
    if layer.block_type == "linear_attention":
        ok = mixer.head_v_dim % 128 == 0 and isinstance(mixer.out_proj, Fp8Linear)
        if not ok or join(mixer, "_hsx_fp8_qkvz", mixer.in_proj_qkv, mixer.in_proj_z) is None:
            return None
    else:
        ok = mixer.head_dim % 128 == 0 and isinstance(mixer.o_proj, Fp8Linear)
        if not ok or join(mixer, "_hsx_fp8_qkv", mixer.q_proj, mixer.k_proj, mixer.v_proj) is None:
            return None
    return _decoder_layer_forward


def _act(qs, shape, dtype) -> Fp8Activation:
    return Fp8Activation(qs[0], qs[1], tuple(shape), dtype)


def _gdn(self, qa: Fp8Activation, normed, B: int, T: int):
    hv, dv = self.num_v_heads, self.head_v_dim
    qkvz = self._hsx_fp8_qkvz(qa)  # [B, T, conv_dim + vd]
    qkv, z = qkvz[..., : self.conv_dim], qkvz[..., self.conv_dim :]
    o = delta_rule(self, qkv, normed)
    qo = fk.gated_rms_norm_quant(o, z.view(B, T, hv, dv), self.norm.weight, self.norm.variance_epsilon)
    return self.out_proj(_act(qo, (B, T, hv * dv), normed.dtype))


def _attention(self, qa: Fp8Activation, B: int, T: int, position_embeddings, attention_mask):
    D = self.head_dim
    nq, nk = self.q_proj.out_features, self.k_proj.out_features
    qkv = self._hsx_fp8_qkv(qa)
    qg = qkv[..., :nq].view(B, T, -1, 2 * D)  # per head: query, then its output gate
    k = qkv[..., nq : nq + nk].view(B, T, -1, D)
    v = qkv[..., nq + nk :].view(B, T, -1, D)
    out = attend(self, qg, k, v, position_embeddings, attention_mask)
    qo = fk.sigmoid_gate_quant(out, qg[..., D:])
    return self.o_proj(_act(qo, (B, T, qo[0].shape[-1]), qkv.dtype))


def _decoder_layer_forward(
    self, hidden_states, position_embeddings, attention_mask=None, position_ids=None, **kwargs
):
    B, T, H = hidden_states.shape
    x = hidden_states.reshape(-1, H)
    norm = self.input_layernorm
    dtype = hidden_states.dtype
    if self.block_type == "linear_attention":
        q, s, normed = fk.rms_norm_quant(x, norm.weight, norm.eps, normed=True)
        if attention_mask is not None:  # a mask the right-padding hook kept: padded inputs zeroed, as stock
            normed = (normed.view(B, T, H) * attention_mask[:, :, None]).to(dtype).view(-1, H)
            q, s = fk.quantize_rows(normed)
        h = _gdn(self.linear_attn, _act((q, s), (B, T, H), dtype), normed.view(B, T, H), B, T)
    else:
        qa = _act(fk.rms_norm_quant(x, norm.weight, norm.eps), (B, T, H), dtype)
        h = _attention(self.self_attn, qa, B, T, position_embeddings, attention_mask)
    post = self.post_attention_layernorm
    q, s, residual = fk.rms_norm_quant(h.reshape(-1, H), post.weight, post.eps, residual=x)
    mlp = self.mlp
    gu = mlp._hsx_fp8_gate_up(_act((q, s), (B * T, H), dtype))
    act = fk.silu_mul_quant(gu)
    residual += mlp.down_proj(_act(act, (B * T, act[0].shape[-1]), dtype))
    return residual.view(B, T, H)
