"""fp8 storage error: relative L2 per layer and cosine similarity per token vector, on states that can be made here.

    python scripts/fp8_error.py                      # tiny random qwen3_5 model (CPU) + real-shaped random bf16 states
    python scripts/fp8_error.py --json-out fp8.json

(1) The tiny model of the demo: every layer's output for the demo conversations, captured by a plain HF forward in
float32 and cast to bf16 (what a bf16 run would store), then quantized as ``--storage-dtype float8_e4m3fn`` does.
(2) Real-shaped bf16 states ([4096 tokens, 5120]) drawn from heavy-tailed distributions, with per-token scale spread
and with a few "massive activation" channels of growing size (LLM residual streams have such channels; their size
decides how much precision the other channels keep under one absmax scale per vector).

``--gpu-config configs/qwen3.6-27b`` (on a CUDA host; ``scripts/gpu_session.sh fp8``) adds (3): the real
architecture with random bf16 weights on the GPU, the DFlash layers and the final state captured by the Extractor
for ~16k tokens of realistic lengths, each slot quantized as a run would. On real weights the same figures come from
``hsextract dry-run --storage-dtype float8_e4m3fn`` (its layer map reports the fp8 error of each captured layer on
real samples).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from benchlib import extractor, realistic_samples

from hsextract.output.fp8 import dequantize_fp8, quantization_error, quantize_fp8


def tiny_model_errors(num_conversations: int = 40) -> list[dict]:
    from transformers import AutoTokenizer

    from hsextract.demo import build_model, make_conversations
    from hsextract.model.load import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "tiny")
        lm = load_model(str(model_dir), dtype="float32", device="cpu")
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    per_layer: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode():
        for conv in make_conversations(num_conversations, seed=1):
            text = tok.apply_chat_template(conv["messages"], tools=conv.get("tools"), tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            hs = lm(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for k in range(len(hs) - 1):  # hs[k + 1] = output of layer k; the last one is normed, skip it
                if k + 2 < len(hs):
                    per_layer.setdefault(k, []).append(hs[k + 1][0].to(torch.bfloat16))
    rows = []
    for k, chunks in sorted(per_layer.items()):
        x = torch.cat(chunks)
        rows.append({"layer": k, "tokens": x.shape[0], **quantization_error(x)})
    return rows


def synthetic_errors(tokens: int = 4096, hidden: int = 5120, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    cases = {
        "gaussian": torch.randn(tokens, hidden, generator=g),
        "gaussian, per-token scale 0..20": torch.randn(tokens, hidden, generator=g)
        * torch.rand(tokens, 1, generator=g)
        * 20,
        "student-t (3 dof)": torch.distributions.StudentT(3.0).sample((tokens, hidden)),
    }
    for name, x in cases.items():
        rows.append({"case": name, **quantization_error(x.to(torch.bfloat16))})
    channels = torch.tensor([17, hidden // 2, hidden - 7])
    keep = torch.ones(hidden, dtype=torch.bool)
    keep[channels] = False
    for magnitude in (100, 1_000, 10_000, 30_000, 100_000):
        x = torch.randn(tokens, hidden, generator=g)
        x[:, channels] = magnitude * torch.sign(torch.randn(tokens, len(channels), generator=g))
        x = x.to(torch.bfloat16)
        q, s = quantize_fp8(x)
        back = dequantize_fp8(q, s, torch.float64)[:, keep]
        ref = x.double()[:, keep]
        rest = ((back - ref).norm() / ref.norm()).item()
        rows.append(
            {
                "case": f"3 channels at {magnitude}x the others' std",
                **quantization_error(x),
                "rel_l2_other_channels": rest,
            }
        )
    return rows


def gpu_errors(config: str, layers: str = "dflash", tokens: int = 16_384) -> list[dict]:
    from hsextract.layers import resolve_layer_ids
    from hsextract.model.load import load_model
    from hsextract.output import StateLayout
    from hsextract.prepare.plan import make_plan

    lm = load_model(config, dtype="bfloat16", device="cuda", random_weights=True)
    n = lm.config.num_hidden_layers
    slots = StateLayout(resolve_layer_ids(layers, n), n, final_state=True).slot_layers
    samples = realistic_samples(tokens, lm.config.vocab_size, 4096)
    plan = make_plan(samples.lengths.tolist(), max_tokens_per_batch=16_384, max_rows=512, shards=1)
    device = torch.device("cuda", 0)
    ext = extractor(lm, slots, plan.batches, device, num_slots=2)
    captured: list[torch.Tensor] = []
    ext.run(plan.batches, samples, lambda b, t: captured.append(t["hidden_states"].clone()))
    states = torch.cat(captured)  # [tokens, slots, H] bfloat16
    return [
        {"layer": k, "tokens": states.shape[0], **quantization_error(states[:, j].to(device))}
        for j, k in enumerate(slots)
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out")
    ap.add_argument("--gpu-config", help="also: this architecture with random weights on the GPU (CUDA only)")
    args = ap.parse_args()
    result = {"tiny_model": tiny_model_errors(), "synthetic": synthetic_errors()}
    if args.gpu_config:
        result["gpu_random_weights"] = gpu_errors(args.gpu_config)
        for r in result["gpu_random_weights"]:
            print(
                f"GPU layer {r['layer']}: rel L2 {r['rel_l2']:.4f}  cos min {r['cos_min']:.5f}  mean {r['cos_mean']:.5f}"
            )
    for r in result["tiny_model"]:
        print(
            f"tiny layer {r['layer']}: rel L2 {r['rel_l2']:.4f}  cos min {r['cos_min']:.5f}  mean {r['cos_mean']:.5f}"
        )
    for r in result["synthetic"]:
        extra = (
            f"  other channels rel L2 {r['rel_l2_other_channels']:.4f}"
            if "rel_l2_other_channels" in r
            else ""
        )
        print(
            f"{r['case']}: rel L2 {r['rel_l2']:.4f}  cos min {r['cos_min']:.5f}  mean {r['cos_mean']:.5f}{extra}"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
