"""What one loader process delivers from /dev/shm into pinned, GPU-ready tensors, on a GPU host.

The synthetic output of ``bench_loader.py`` (the default target's DFlash shape: 5 layers x 5120, bf16, 51,200
bytes of states per token), read by ``StatesDataset`` (DFlash schema, checksums verified) in this one process
with ``--threads`` read threads; each item's states are copied into a pinned host buffer and on to the GPU
(non-blocking, one stream), as a training loop's ``pin_memory`` + ``.cuda()`` would. Prints one line a figure:
GB/s of states into pinned memory, and with the copy to the GPU; how many such processes ~3 GB/s of states per
GPU needs. Without CUDA it stops after the pinned-memory figure's CPU twin (plain memory).

    python scripts/bench_loader_gpu.py --files 8 --tokens 16384 --threads 1,4,8
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_loader import make_output  # noqa: E402

from hsextract.training import StatesDataset  # noqa: E402

NEED_GBPS = 3.0  # a 1B-parameter drafter on an H200 (docs/PERFORMANCE.md, "Training loader")


def deliver(out: Path, threads: int, cuda: bool) -> tuple[float, int]:
    data = StatesDataset(str(out), schema="specforge-dflash", shuffle=True, seed=0, threads=threads)
    stream = torch.cuda.Stream() if cuda else None
    pinned: torch.Tensor | None = None
    nbytes = 0
    t0 = time.perf_counter()
    for item in data:
        states = item["hidden_states"]
        n = states.numel() * states.element_size()
        if pinned is None or pinned.numel() < states.numel():
            pinned = torch.empty(states.numel() * 2, dtype=states.dtype, pin_memory=cuda)
        host = pinned[: states.numel()].view_as(states)
        if stream is not None:
            stream.synchronize()  # the last copy out of the buffer is done before it is refilled
        host.copy_(states)
        if stream is not None:
            with torch.cuda.stream(stream):
                host.to("cuda", non_blocking=True)
        nbytes += n
    if stream is not None:
        stream.synchronize()
    return nbytes / (time.perf_counter() - t0) / 1e9, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--threads", default="1,4,8")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hsx-loader-") as tmp:
        out = Path(tmp) / "out"
        make_output(out, args.files, args.tokens)
        print(
            f"figure output {args.files} files x {args.tokens} tokens in {args.dir}; cuda {cuda}", flush=True
        )
        for threads in map(int, args.threads.split(",")):
            for target in ("host", "gpu") if cuda else ("host",):
                best, nbytes = 0.0, 0
                for _ in range(args.repeat):
                    rate, nbytes = deliver(out, threads, cuda and target == "gpu")
                    best = max(best, rate)
                print(
                    f"figure threads_{threads}.{target}_gbps {best:.2f} ({nbytes / 1e9:.2f} GB; "
                    f"processes for {NEED_GBPS:g} GB/s: {math.ceil(NEED_GBPS / best)})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
