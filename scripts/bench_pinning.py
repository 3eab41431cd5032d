"""What the pipeline's pinned host buffers cost to make, two ways, on a CUDA host.

(1) ``torch.empty(n, pin_memory=True)``: PyTorch's caching host allocator (cudaHostAlloc of the next power of two);
(2) ``hsextract.run.hostmem.pinned_empty``: the exact size, pages faulted in by torch's threads, then
cudaHostRegister. Each makes ``--slots`` buffers of ``--gb`` GB in a fresh process (no allocator cache to reuse),
then times a device-to-host copy of the whole buffer (GB/s: pinned memory copies at the link's rate, pageable at
a fraction of it). One ``figure NAME VALUE`` line each.

    python3 scripts/bench_pinning.py --slots 3 --gb 2.75
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROBE = """
import json, sys, time, torch
way, slots, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.empty(1, device="cuda")
t0 = time.perf_counter()
if way == "torch":
    bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
else:
    from hsextract.run.hostmem import pinned_empty
    bufs = [pinned_empty(nbytes) for _ in range(slots)]
made = time.perf_counter() - t0
src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
bufs[0].copy_(src, non_blocking=True)
torch.cuda.synchronize()
t1 = time.perf_counter()
for b in bufs:
    b.copy_(src, non_blocking=True)
torch.cuda.synchronize()
copy = time.perf_counter() - t1
print(json.dumps({"made_s": round(made, 2), "d2h_gbps": round(slots * nbytes / copy / 1e9, 1),
                  "pinned": all(b.is_pinned() for b in bufs)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--gb", type=float, default=2.75)
    args = ap.parse_args()
    nbytes = int(args.gb * 1e9)
    for way in ("torch", "register"):
        r = subprocess.run(
            [sys.executable, "-c", PROBE, way, str(args.slots), str(nbytes)], capture_output=True, text=True
        )
        if r.returncode != 0:
            print(f"figure {way}.error {json.dumps(r.stderr[-800:])}", flush=True)
            continue
        for key, value in json.loads(r.stdout.strip().splitlines()[-1]).items():
            print(f"figure {way}.{key} {json.dumps(value)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
