"""Peak memory of the fast load (startup/fastload.py) of an FP8 checkpoint, with its e4m3 tensors widened in the read
state dict (as run) and left as read (as before): on a CUDA host the peak allocated on the GPU, else peak host RSS.

    python scripts/make_checkpoint.py configs/qwen3.6-27b DIR --layers 4 --vocab 2048 --fp8-only  # the layers dominate
    python scripts/bench_fp8_load.py DIR [--as-before]  # one load in this process; run each mode apart
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def measure(model: Path, as_before: bool) -> None:
    import hsextract.startup.fastload as fastload
    from hsextract.model.fp8_load import unquantized_config

    if as_before:  # the load before the widening: transformers casts beside the e4m3 tensors the dict holds
        fastload.widen_fp8 = lambda state, dtype: None
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    lm = fastload.fast_load(
        str(model),
        dtype=torch.bfloat16,
        attn_implementation="sdpa",
        device=device,
        config=unquantized_config(str(model)),
    )
    seconds = time.perf_counter() - t0
    if cuda:
        peak, what = torch.cuda.max_memory_allocated(), "GPU peak allocated"
    else:
        peak, what = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak host RSS"
    size = sum(p.numel() * p.element_size() for p in lm.parameters())
    print(
        json.dumps(
            {
                "mode": "as before" if as_before else "widened",
                "device": device,
                "model_gb": round(size / 1e9, 2),
                "peak_gb": round(peak / 1e9, 2),
                "peak_is": what,
                "load_s": round(seconds, 1),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="an FP8 checkpoint (scripts/make_checkpoint.py --fp8-only)")
    ap.add_argument("--as-before", action="store_true")
    args = ap.parse_args()
    measure(args.dir, args.as_before)


if __name__ == "__main__":
    main()
