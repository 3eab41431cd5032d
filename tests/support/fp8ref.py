"""The fp8 recipe written apart from hsextract.model.fp8, for the tests that hold a run's stored states against it
(tests/unit/model/test_fp8.py on the CPU, tests/gpu/test_fp8_gpu.py with the fused kernels): a tiny qwen3_5 whose
linears are multiples of 128, and transformers' own forward with the fp8 linears computed by hooks, for the recipe
and for each wrong variant of it."""

import torch
from safetensors.torch import load_file

BLOCK = 128
LAYERS = (0, 1, 2, 3)


def tiny_fp8_config(vocab_size: int, wide: bool = False):
    """A 4-layer qwen3_5 (3 Gated-DeltaNet layers, 1 full attention) whose linears are multiples of 128; ``wide``:
    of 512 (those the fused fp8 forward runs: cuBLASLt's block-scaled GEMM refuses some narrower ones), but
    k_proj and v_proj alone."""
    n = 2 if wide else 1
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=256 * n,
        intermediate_size=384 if not wide else 1024,
        num_hidden_layers=4,
        num_attention_heads=2 * n,
        num_key_value_heads=n,
        head_dim=128,
        linear_num_key_heads=n,
        linear_num_value_heads=2 * n,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )


def write_checkpoints(root, wide: bool = False):
    """(bf16 dir, FP8 dir) under ``root``: one random bf16 ``tiny_fp8_config`` model with the demo's tokenizer, and
    the same saved in the served FP8 layout (hsextract.model.fp8_load.write_fp8_checkpoint)."""
    from transformers import Qwen3_5ForCausalLM

    from hsextract.demo import build_tokenizer
    from hsextract.model import fp8_load

    bf16_dir, fp8_dir = root / "bf16", root / "fp8"
    tok = build_tokenizer(bf16_dir)
    build_tokenizer(fp8_dir)
    torch.manual_seed(0)
    config = tiny_fp8_config(len(tok), wide)
    config.pad_token_id = config.eos_token_id = tok.pad_token_id
    lm = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        lm.model.embed_tokens.weight.normal_(0.0, 1.0)
    lm.save_pretrained(bf16_dir)
    fp8_load.write_fp8_checkpoint(lm, fp8_dir)
    return bf16_dir, fp8_dir


def dry_run_config(fp8_dir, root, lengths, **run):
    """A dry run's config on ``fp8_dir`` (layers 0, 1 and 3): one row of random ids per length, written under
    ``root``; ``run``: the device, dtype and other fields of the run."""
    import json

    from hsextract.config import RunConfig
    from support.cli import TINY_LIMITS

    g = torch.Generator().manual_seed(5)
    rows = [
        {"id": f"s{i}", "input_ids": torch.randint(1, 200, (n,), generator=g).tolist()}
        for i, n in enumerate(lengths)
    ]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunConfig(
        model=str(fp8_dir),
        data=str(data),
        output=str(root / "o"),
        run_dir=str(root / "r"),
        layers=(0, 1, 3),
        **TINY_LIMITS,
        num_proc=1,
        **run,
    )


def _fake_quant(x, group):
    """Quantize-dequantize ``x`` [..., K] with one scale (amax / 448) per ``group`` columns, written here apart from
    fp8.py."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    s = g.abs().amax(-1, keepdim=True) / 448
    q = (g / torch.where(s > 0, s, torch.ones_like(s))).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() * s).reshape(x.shape)


VARIANTS = (
    "recipe",
    "activations not quantized",
    "one scale per token",
    "scales inverted",
    "scales transposed",
    "scales ignored",
    "bf16 weights",
)


def reference_states(bf16_dir, fp8_dir, samples: dict, dtype) -> dict:
    """variant -> sample id -> [layer] float32 states of an unbatched transformers forward in ``dtype`` whose fp8
    linears compute, in float32 from their ``dtype`` input, with the checkpoint's dequantized weights (or a wrong
    variant's) and fake-quantized inputs, their output rounded to ``dtype``: the recipe written apart from fp8.py."""
    from transformers import Qwen3_5ForCausalLM

    stored = load_file(str(fp8_dir / "model.safetensors"))
    lm = Qwen3_5ForCausalLM.from_pretrained(str(bf16_dir), dtype=dtype).eval()
    scaled = [k.removesuffix(".weight_scale_inv") for k in stored if k.endswith(".weight_scale_inv")]
    original = {name: lm.get_submodule(name).weight.detach().float().clone() for name in scaled}
    captured = {}
    for k in LAYERS:
        lm.model.layers[k].register_forward_hook(
            lambda m, a, out, k=k: captured.__setitem__(k, out if torch.is_tensor(out) else out[0])
        )
    out = {}
    for variant in VARIANTS:
        handles = []
        for name in scaled:
            mod = lm.get_submodule(name)
            q, s = stored[f"{name}.weight"].float(), stored[f"{name}.weight_scale_inv"].float()
            if variant == "scales inverted":
                s = torch.where(s > 0, 1 / s, torch.zeros_like(s))
            elif variant == "scales transposed":
                s = s.t().contiguous().view(s.shape)
            elif variant == "scales ignored":
                s = torch.ones_like(s)
            full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            w = original[name] if variant == "bf16 weights" else q * full
            group = mod.in_features if variant == "one scale per token" else BLOCK
            quantized = variant not in ("activations not quantized", "bf16 weights")

            def linear(m, args, output, w=w, group=group, quantized=quantized):
                x = args[0].float()
                return ((_fake_quant(x, group) if quantized else x) @ w.t()).to(output.dtype)

            handles.append(mod.register_forward_hook(linear))
        with torch.inference_mode():
            for sid, ids in samples.items():
                lm(torch.tensor([ids]), use_cache=False)
                out.setdefault(variant, {})[sid] = [captured[k][0].float() for k in LAYERS]
        for h in handles:
            h.remove()
    return out


def rel(a: list, b: list) -> float:
    """Relative L2 distance; infinite where the reference is not finite (inverted scales overflow)."""
    a, b = torch.cat(a), torch.cat(b)
    d = ((a - b).norm() / b.norm()).item()
    return d if d == d and b.isfinite().all() else float("inf")


def distances(out, refs, samples) -> dict:
    """Per layer: each variant's relative L2 distance from the stored states of ``out``."""
    table = {}
    for li, k in enumerate(LAYERS):
        mine = [out[sid]["layers"][k].float() for sid in samples]
        table[k] = {v: rel(mine, [refs[v][sid][li] for sid in samples]) for v in VARIANTS}
    return table
