"""Save a random-weight checkpoint of a config's architecture (no download), for GPU runs of `hsextract run`.

    python scripts/make_checkpoint.py configs/qwen3.6-27b /data/qwen3.6-27b-random [--layers 8] [--vocab N]
        [--tokenizer DIR] [--fp8 /data/qwen3.6-27b-random-fp8 | --fp8-only]

The weights are random (bf16, built on the GPU when there is one); the tokenizer is the demo BPE unless given.
Token ids of the data must be below the tokenizer's size, which is far below the real vocab: fine for timing.
``--fp8 DIR`` also saves the same weights in the served FP8 layout (Qwen3.x-FP8's: e4m3 weights and a bf16
``weight_scale_inv`` per 128x128 tile, ``quantization_config`` fp8; hsextract.model.fp8_load.write_fp8_checkpoint);
``--fp8-only`` writes only that layout, in ``out`` (half the bytes: where the disk cannot hold both).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from hsextract.demo import build_tokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    ap.add_argument(
        "--vocab", type=int, help="an embedding and head of N tokens (the demo tokenizer's fit in 2,048)"
    )
    ap.add_argument("--tokenizer")
    ap.add_argument("--fp8", help="also write the served FP8 layout of the same weights here")
    ap.add_argument("--fp8-only", action="store_true", help="write only the served FP8 layout, in OUT")
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.time()
    cfg = AutoConfig.from_pretrained(args.config)
    if args.layers:
        cfg.num_hidden_layers = args.layers
        cfg.layer_types = cfg.layer_types[: args.layers]
    if args.vocab:
        cfg.vocab_size = args.vocab
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if args.fp8_only:
        from hsextract.model.fp8_load import write_fp8_checkpoint

        write_fp8_checkpoint(lm, out)
    else:
        lm.save_pretrained(out, max_shard_size="10GB")
    if args.tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(out)
    else:
        build_tokenizer(out)
    if args.fp8:
        from transformers import AutoTokenizer

        from hsextract.model.fp8_load import write_fp8_checkpoint

        write_fp8_checkpoint(lm, args.fp8)
        AutoTokenizer.from_pretrained(str(out)).save_pretrained(args.fp8)
    print(
        json.dumps(
            {
                "out": str(out),
                "layers": cfg.num_hidden_layers,
                "seconds": time.time() - t0,
                "params": sum(p.numel() for p in lm.parameters()),
            }
        )
    )


if __name__ == "__main__":
    main()
