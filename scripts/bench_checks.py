"""What the run's integrity checks cost, beside the work they guard.

    python scripts/bench_checks.py [--tokens 65536] [--slots 6] [--hidden 5120] [--dir /dev/shm]

- ``state_health`` (run/pipeline.py), the per-batch NaN/Inf/all-zero check on the device, on a batch's gathered
  states [tokens, slots, hidden] in bfloat16, and on fp8 storage's scales: milliseconds per batch (CUDA events,
  median of 10 after a warm-up), against the batch's forward at the measured steady state (``--tokens-per-s``).
- The CRC32 of a batch file computed from its bytes (``storage.base.read_with_crc32``, what a local output's
  finish and verify read), on a file of that batch's size in ``--dir``: GB/s, and seconds per batch.
Prints ``figure NAME VALUE`` lines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--slots", type=int, default=6, help="stored layers (DFlash: 5, + the final state)")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--tokens-per-s", type=float, default=12250.0, help="the forward's steady state")
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    import torch

    from hsextract.run.pipeline import state_health
    from hsextract.storage.base import read_with_crc32

    batch_bytes = args.tokens * args.slots * args.hidden * 2
    forward_s = args.tokens / args.tokens_per_s
    print(f"figure batch_gb {batch_bytes / 1e9:.2f}")
    print(f"figure forward_s {forward_s:.2f}")
    if torch.cuda.is_available():
        out = torch.randn(args.tokens, args.slots, args.hidden, device="cuda", dtype=torch.bfloat16)
        scale = out.float().abs().amax(dim=2)
        for name, fn in (
            ("bf16", lambda: state_health(out, None)),
            ("fp8_scale", lambda: state_health(out, scale)),
        ):
            fn()
            times = []
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            ms = statistics.median(times)
            print(f"figure state_check_{name}_ms {ms:.2f}")
            print(f"figure state_check_{name}_of_forward {ms / 1e3 / forward_s:.5f}")
        del out, scale
    path = Path(args.dir) / f"hsextract-bench-crc-{os.getpid()}.bin"
    chunk = os.urandom(64 << 20)
    try:
        with open(path, "wb") as f:
            for _ in range(max(1, batch_bytes // len(chunk))):
                f.write(chunk)
        size = path.stat().st_size
        read_with_crc32(path)  # once to have it in the page cache, as a just-written file is
        t0 = time.perf_counter()
        read_with_crc32(path)
        s = time.perf_counter() - t0
        print(f"figure crc32_file_gb {size / 1e9:.2f}")
        print(f"figure crc32_gb_per_s {size / 1e9 / s:.2f}")
        print(f"figure crc32_s_per_batch {s * batch_bytes / size:.2f}")
        print(f"figure crc32_of_forward {s * batch_bytes / size / forward_s:.3f}")
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
