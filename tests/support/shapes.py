"""The ``qwen3_5`` checkpoints that ship, as tiny random models: what sets them apart (layer pattern, query/key-value
and Gated-DeltaNet head ratios, partial interleaved M-RoPE, YaRN, MTP tensors, tied embeddings, the vision tower)
kept, the sizes cut.

Sources: Qwen3.6-27B's config.json (text_config); Qwen3.5-0.8B's as pinned by NVIDIA ModelOpt's puzzletron tests;
Qwen3.8-27B is the Qwen3.6-27B architecture (FACTS.md; NeMo Automodel and SGLang's model pages: 64 layers, three
Gated-DeltaNet layers then one full attention, hidden 5120, one MTP layer, 262,144 positions) with a second config,
``config_1M.json``, that turns on YaRN (factor 4 over 262,144) for 1M tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN3_6_27B = dict(
    interval=4,
    heads=24,
    kv_heads=4,
    head_dim=256,
    linear_key_heads=16,
    linear_value_heads=48,
    linear_dim=128,
    partial_rotary_factor=0.25,
    rope_theta=10_000_000,
    mrope_section=[11, 11, 10],
    tie=False,
    mtp_layers=1,
)

SHAPES = {
    "qwen3.6-27b": QWEN3_6_27B,
    "qwen3.8-27b": QWEN3_6_27B,
    "qwen3.8-27b-1m": {**QWEN3_6_27B, "yarn": {"factor": 4.0, "original_max_position_embeddings": 262144}},
    # Qwen3.5-0.8B differs in its head counts and its tied embeddings only.
    "qwen3.5-0.8b": {**QWEN3_6_27B, "heads": 8, "kv_heads": 2, "linear_value_heads": 16, "tie": True},
}


def text_config(name: str, *, vocab_size: int = 300, layers: int = 8, real_head_dims: bool = False) -> dict:
    """A tiny ``qwen3_5_text`` config of the shape ``name``: one key-value head (and two Gated-DeltaNet key heads)
    with the real ratios of query and value heads to them; head dims real (for the GPU kernels) or 32 and 16."""
    s = SHAPES[name]
    head_dim = s["head_dim"] if real_head_dims else 32
    linear_dim = s["linear_dim"] if real_head_dims else 16
    rotary_pairs = int(head_dim * s["partial_rotary_factor"]) // 2
    full = sum(s["mrope_section"])
    section = [rotary_pairs * x // full for x in s["mrope_section"]]
    section[0] += rotary_pairs - sum(section)  # M-RoPE's sections cover the rotary pairs exactly
    rope = {
        "rope_type": "default",
        "rope_theta": s["rope_theta"],
        "partial_rotary_factor": s["partial_rotary_factor"],
        "mrope_interleaved": True,
        "mrope_section": section,
    }
    if "yarn" in s:
        rope.update(rope_type="yarn", **s["yarn"])
    hidden = 256 if real_head_dims else 64
    return dict(
        model_type="qwen3_5_text",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        layer_types=[
            "full_attention" if (i + 1) % s["interval"] == 0 else "linear_attention" for i in range(layers)
        ],
        num_attention_heads=s["heads"] // s["kv_heads"],
        num_key_value_heads=1,
        head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=2 * s["linear_value_heads"] // s["linear_key_heads"],
        linear_key_head_dim=linear_dim,
        linear_value_head_dim=linear_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=1_048_576 if "yarn" in s else 262_144,
        rope_parameters=rope,
        tie_word_embeddings=s["tie"],
        mtp_num_hidden_layers=s["mtp_layers"],
        attn_output_gate=True,
        initializer_range=0.1,  # consecutive layers differ by far more than any tolerance
    )


def build(name: str, out_dir: Path, *, real_head_dims: bool = False, dtype=None, seed: int = 0):
    """The shape ``name`` as a released checkpoint is laid out: ``Qwen3_5ForConditionalGeneration`` with a small
    vision tower, plus the MTP layer's tensors (``mtp.*``, which transformers does not load) in a file of their
    own, named by the index. Returns the model (the reference) and the checkpoint directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = text_config(name, real_head_dims=real_head_dims)
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"]
    )
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"]
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    if dtype is not None:
        model = model.to(dtype)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, max_shard_size="1GB")
    h = text["hidden_size"]
    mtp = {
        "mtp.fc.weight": torch.randn(h, 2 * h),
        "mtp.norm.weight": torch.zeros(h),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(h),
    }
    save_file({k: v.to(model.dtype) for k, v in mtp.items()}, out_dir / "model-mtp.safetensors")
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        from safetensors import safe_open

        (out_dir / "model.safetensors").rename(out_dir / "model-main.safetensors")
        with safe_open(out_dir / "model-main.safetensors", "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model-main.safetensors")
    weight_map.update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model, out_dir
