"""What a new batch shape costs in the steady state, beside its forward, on a CUDA host.

The worker's own path (``load_model_for``: fused kernels, the recorded autotune choices; the ``Extractor`` with
hooks on the DFlash layers, stopping after the deepest) runs one plan of length-sorted, padded batches twice in
one process. Every batch of the first pass has a shape this process has not run; the second pass runs the same
shapes again. Per batch, the time between two batches reaching the host (the pipeline's steady rhythm, the
forward of the later one) is compared across the passes: pass 1 minus pass 2 is what the new shape cost. The
first batch of each pass is left out (the first one also pays the process's first-call costs). Board power and
SM clock are sampled by NVML during each pass. Prints ``figure NAME VALUE`` lines.

    python3 scripts/bench_shapes.py --model /tmp/hsextract-ckpt-27b --tokens 200000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


class Sampler:
    """Board power (W) and SM clock (MHz) of GPU 0 every ``period`` s, through NVML, while active."""

    def __init__(self, period: float = 0.2):
        self.period, self.samples, self.stop = period, [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self.nvml = None

    def __enter__(self):
        self.samples, self.stop = [], threading.Event()
        if self.nvml is not None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        return self

    def _run(self):
        n = self.nvml
        while not self.stop.wait(self.period):
            power = n.nvmlDeviceGetPowerUsage(self.handle) / 1000
            clock = n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM)
            self.samples.append((power, clock))

    def __exit__(self, *exc):
        self.stop.set()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        busy = sorted(self.samples)[len(self.samples) // 4 :]  # the busiest three quarters (not the gaps)
        return {
            "power_w_median": round(statistics.median(p for p, _ in busy), 1),
            "sm_mhz_median": round(statistics.median(c for _, c in busy)),
        }


def prewarm(cfg, plan, work: Path) -> None:
    """The run's warm-up (``hsextract.model.warmup``) for ``plan``, into a fresh kernel cache this process then
    uses (set before Triton is imported: the warm-up's kernels are the ones the passes find)."""
    import os
    import shutil
    import subprocess

    from hsextract.run.launcher import warmup_spec

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    warmup_spec(cfg, plan).save(work / "warmup.json")
    os.environ["TRITON_CACHE_DIR"] = str(work / "kernels")
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "hsextract.model.warmup", str(work / "warmup.json")],
        capture_output=True,
        text=True,
    )
    print(f"figure prewarm_s {time.perf_counter() - t0:.1f}", flush=True)
    print(f"figure prewarm_exit {r.returncode}", flush=True)
    if r.returncode != 0:
        print(r.stdout[-1500:] + r.stderr[-1500:], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=200000)
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument(
        "--seed", type=int, default=7, help="another seed, other shapes than the start-up bench's"
    )
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (the demo's tiny model)")
    ap.add_argument(
        "--prewarm",
        action="store_true",
        help="first run the run's kernel warm-up for this plan into a fresh kernel cache, as `hsextract run` does "
        "beside its load (without: the kernels of new shapes compile in the passes)",
    )
    ap.add_argument("--work", default="/tmp/hsextract-bench-shapes")
    args = ap.parse_args()
    import torch

    from hsextract.config import RunConfig
    from hsextract.format.batch import StateLayout
    from hsextract.layers import resolve_layer_ids
    from hsextract.model.load import load_model_config, load_model_for
    from hsextract.prepare.plan import make_plan
    from hsextract.prepare.tokenfile import TokenizedSamples
    from hsextract.run.pipeline import Extractor

    cfg = RunConfig(
        model=args.model,
        data="unused",
        output="/tmp/unused",
        run_dir="/tmp/unused-run",
        device=args.device,
        dtype="bfloat16",
        max_length=args.max_length,
        max_tokens_per_batch=args.max_tokens,
    )
    _, text, num_layers = load_model_config(args.model)
    layers = StateLayout(resolve_layer_ids(cfg.layers, num_layers), num_layers, False, None).slot_layers
    rng = np.random.default_rng(args.seed)
    lengths = []
    while sum(lengths) < args.tokens:  # chat-like: many short, some long
        lengths.append(int(min(args.max_length, max(16, rng.lognormal(6.2, 1.0)))))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, min(text.vocab_size, 32000), offsets[-1], dtype=np.int32)
    samples = TokenizedSamples(
        sample_ids=[str(i) for i in range(len(lengths))],
        input_ids=ids,
        loss_mask=np.ones_like(ids, dtype=np.uint8),
        offsets=offsets,
    )
    plan = make_plan(lengths, max_tokens_per_batch=args.max_tokens, max_rows=cfg.max_rows, shards=1)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.prewarm:
        prewarm(cfg, plan, Path(args.work))
    t0 = time.perf_counter()
    lm = load_model_for(cfg, device)
    print(f"figure load_s {time.perf_counter() - t0:.1f}", flush=True)
    ext = Extractor(
        lm,
        layers,
        device=device,
        max_tokens=max(b.num_tokens for b in plan.batches),
        num_slots=3,
        pad_token_id=0,
    )
    sampler = Sampler()
    passes = []
    for p in range(2):
        seen: list[tuple[int, float]] = []
        with sampler:
            t0 = time.perf_counter()
            ext.run(
                plan.batches, samples, lambda b, t, seen=seen: seen.append((b.batch_id, time.perf_counter()))
            )
            wall = time.perf_counter() - t0
        passes.append((dict(seen), [b for b, _ in seen], wall, sampler.summary()))
        tokens = sum(b.num_tokens for b in plan.batches)
        padded = sum(b.rows * b.padded_length for b in plan.batches)
        print(f"figure pass{p + 1}.wall_s {wall:.2f}", flush=True)
        print(f"figure pass{p + 1}.tokens_per_s {tokens / wall:.0f}", flush=True)
        print(f"figure pass{p + 1}.padded_tokens_per_s {padded / wall:.0f}", flush=True)
        for key, value in passes[-1][3].items():
            print(f"figure pass{p + 1}.{key} {value}", flush=True)
    (t1, order, *_), (t2, *_) = passes
    rows = []
    by_id = {b.batch_id: b for b in plan.batches}
    for prev, cur in zip(order, order[1:], strict=False):
        b = by_id[cur]
        a, c = t1[cur] - t1[prev], t2[cur] - t2[prev]
        rows.append(
            {
                "batch": cur,
                "rows": b.rows,
                "padded_length": b.padded_length,
                "tokens": b.num_tokens,
                "pass1_s": round(a, 3),
                "pass2_s": round(c, 3),
                "new_shape_s": round(a - c, 3),
            }
        )
    extra = [r["new_shape_s"] for r in rows]
    print(f"figure batches {len(plan.batches)}", flush=True)
    print(f"figure new_shape_s_median {statistics.median(extra):.3f}", flush=True)
    print(f"figure new_shape_s_max {max(extra):.3f}", flush=True)
    print(f"figure per_batch {json.dumps(rows)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
