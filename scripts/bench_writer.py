"""What the staged file's CRC32 costs the writer thread: ``write_batch_file`` with it and with it stubbed out.

A batch of ``--tokens`` tokens x ``--slots`` slots x ``--hidden`` bfloat16 states (4096 x 4 x 16384 = 537 MB by
default) is written ``--repeats`` times each way, alternating, into ``--dir``; prints the median seconds and GB/s.
The CRC32 runs in a second thread beside the write (run/writer.py), so on a machine with a free core it costs
little beyond the write itself.

    PYTHONPATH=src python scripts/bench_writer.py --dir /tmp
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from hsextract.format.batch import batch_metadata
from hsextract.run import writer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    n = args.tokens
    tensors = {
        "hidden_states": torch.randn(n, args.slots, args.hidden).to(torch.bfloat16),
        "input_ids": torch.zeros(n, dtype=torch.int32),
        "loss_mask": torch.ones(n, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, n]),
        "sample_index": torch.tensor([0]),
    }
    meta = batch_metadata(run_meta={}, batch_id=0, shard=0, sample_ids=["a"])
    path = Path(args.dir) / f"bench-writer-{os.getpid()}.safetensors"
    real = writer.crc32_of
    times: dict[str, list[float]] = {"with CRC32": [], "without": []}
    size = 0
    for _ in range(args.repeats):
        for label, crc in (("with CRC32", real), ("without", lambda parts: 0)):
            writer.crc32_of = crc
            start = time.perf_counter()
            size, _ = writer.write_batch_file(path, tensors, meta)
            times[label].append(time.perf_counter() - start)
            path.unlink()
    writer.crc32_of = real
    for label, seconds in times.items():
        median = statistics.median(seconds)
        print(
            f"{label:>10}: {size / 1e6:.0f} MB in {median:.2f} s ({size / median / 1e9:.2f} GB/s), median of {len(seconds)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
