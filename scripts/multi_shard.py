"""Run the real command with several shards, kill one worker mid-run, resume, and measure what users measure.

    python scripts/multi_shard.py --model CKPT --work /tmp/ms --shards 4 --gpus 0,1,2,3 --tokens 600000

Steps: write a realistic pre-tokenized dataset (median 221, mean ~330, p99 ~1800 tokens); (1) a 1-shard run for the
single-shard rate; (2) an N-shard run in which one worker is SIGKILLed once a third of its batches are durable,
then the same command again to resume. Reports tokens/s per shard and aggregate, the scaling ratio
aggregate / (N x single), time to the first durable batch, peak host memory of the process tree, the staging
high-water mark, and checks exactly-once output through the reader (every sample id once, every batch key once).
On one GPU with ``--gpus 0,0,0,0`` the shards share it: the ratio then measures multi-process overhead, not scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def write_data(path: Path, tokens: int, vocab: int, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    n = 0
    total = 0
    with open(path, "w") as f:
        while total < tokens:
            length = int(np.clip(rng.lognormal(np.log(221), 0.9), 1, 4096))
            ids = rng.integers(1, vocab, length).tolist()
            f.write(json.dumps({"id": f"s{n:07d}", "input_ids": ids}) + "\n")
            n += 1
            total += length
    return n


class TreeSampler(threading.Thread):
    """Peak RSS of a process tree and peak bytes in a staging directory, sampled every 0.2 s."""

    def __init__(self, pid: int, staging: Path):
        super().__init__(daemon=True)
        self.pid, self.staging = pid, staging
        self.peak_rss = 0
        self.peak_staging = 0
        self.stop = False

    def run(self):
        import psutil

        while not self.stop:
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if p.is_running())
                self.peak_rss = max(self.peak_rss, rss)
            except psutil.Error:
                pass
            staged = 0
            for p in self.staging.rglob("*.safetensors"):
                try:
                    staged += p.stat().st_size
                except FileNotFoundError:
                    pass
            self.peak_staging = max(self.peak_staging, staged)
            time.sleep(0.2)


def hsextract(args_list, **kw):
    return subprocess.Popen([sys.executable, "-m", "hsextract.cli", *map(str, args_list)], **kw)


def first_marker_time(run_dir: Path, t0: float, proc) -> float | None:
    while proc.poll() is None:
        if any((run_dir / "markers").rglob("*.done")) if (run_dir / "markers").exists() else False:
            return time.time() - t0
        time.sleep(0.1)
    return None


def run_job(
    common, work: Path, name: str, shards: int, gpus: str, kill_one: bool, staging_root: Path
) -> dict:
    run_dir, out, staging = work / f"{name}-run", work / f"{name}-out", staging_root / f"{name}-staging"
    argv = [
        "run",
        *common,
        "--output",
        out,
        "--run-dir",
        run_dir,
        "--staging",
        staging,
        "--shards",
        shards,
        "--gpus",
        gpus,
        "--no-progress",
    ]
    result: dict = {"shards": shards}
    t0 = time.time()
    log = open(work / f"{name}.log", "w")
    proc = hsextract(argv, stdout=log, stderr=subprocess.STDOUT)
    sampler = TreeSampler(proc.pid, staging)
    sampler.start()
    result["first_durable_batch_s"] = first_marker_time(run_dir, t0, proc)
    if kill_one:
        plan = json.loads((run_dir / "plan.json").read_text())
        mine = [b for b in plan["batches"] if b[1] == shards - 1]
        victim_dir = run_dir / "markers" / f"shard-{shards - 1:05d}"
        while proc.poll() is None:
            done = len(list(victim_dir.glob("*.done"))) if victim_dir.exists() else 0
            if done >= max(1, len(mine) // 3):
                prog = json.loads((run_dir / "progress" / f"shard-{shards - 1:05d}.json").read_text())
                os.kill(prog["pid"], signal.SIGKILL)
                result["killed"] = {
                    "shard": shards - 1,
                    "pid": prog["pid"],
                    "batches_done": done,
                    "of": len(mine),
                }
                break
            time.sleep(0.05)
    rc = proc.wait()
    result["first_attempt_rc"] = rc
    result["first_attempt_s"] = time.time() - t0
    if kill_one:
        t1 = time.time()
        proc = hsextract(argv, stdout=log, stderr=subprocess.STDOUT)
        sampler.pid = proc.pid
        result["resume_rc"] = proc.wait()
        result["resume_s"] = time.time() - t1
    sampler.stop = True
    sampler.join()
    result["wall_s"] = time.time() - t0
    result["peak_host_rss_gb"] = sampler.peak_rss / 1e9
    result["staging_high_water_gb"] = sampler.peak_staging / 1e9
    rates = []
    for s in range(shards):
        p = json.loads((run_dir / "progress" / f"shard-{s:05d}.json").read_text())
        rates.append(p["tokens_per_s"])
    result["tokens_per_s_per_shard"] = rates
    # Exactly once: every sample id once across the output, every planned batch key once, nothing staged.
    from hsextract.reader import open_output

    output = open_output(str(out))
    ids = output.sample_ids()
    keys = sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors"))
    plan = json.loads((run_dir / "plan.json").read_text())
    result["samples"] = len(ids)
    result["samples_unique"] = len(set(ids))
    result["batch_files"] = len(keys)
    result["batches_planned"] = len(plan["batches"])
    result["staging_left"] = len(list(staging.rglob("*.safetensors")))
    result["tokens"] = sum(b[3] for b in plan["batches"])
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", default="/tmp/hsextract-multishard")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--gpus", default="0,1,2,3")
    ap.add_argument("--tokens", type=int, default=600_000)
    ap.add_argument("--layers", default="1,4,6")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens-per-batch", type=int, default=32768)
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--staging-root", help="where the runs stage their files (default: --work)")
    ap.add_argument("--staging-max-gb", type=float, default=4.0)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(args.model))
    data = work / "data.jsonl"
    n = write_data(data, args.tokens, vocab)
    print(f"{n} samples, >= {args.tokens} tokens", flush=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton-cache"))  # shared by both runs
    common = [
        "--model",
        args.model,
        "--data",
        data,
        "--layers",
        args.layers,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-length",
        min(4096, args.max_tokens_per_batch),
        "--max-tokens-per-batch",
        args.max_tokens_per_batch,
        "--num-proc",
        4,
        "--staging-max-gb",
        args.staging_max_gb,
    ]
    staging_root = Path(args.staging_root or work)
    report = {}
    if not args.skip_single:
        report["single"] = run_job(
            common, work, "single", 1, args.gpus.split(",")[0], kill_one=False, staging_root=staging_root
        )
        print(json.dumps(report["single"]), flush=True)
    report["multi"] = run_job(
        common, work, "multi", args.shards, args.gpus, kill_one=True, staging_root=staging_root
    )
    print(json.dumps(report["multi"]), flush=True)
    if "single" in report:
        shutil.rmtree(work / "single-out", ignore_errors=True)  # only its rate is needed; frees the disk
        single = report["single"]["tokens_per_s_per_shard"][0]
        agg = sum(report["multi"]["tokens_per_s_per_shard"])
        report["scaling_ratio"] = agg / (args.shards * single) if single else None
        print(
            f"single shard {single:,.0f} tok/s; {args.shards} shards aggregate {agg:,.0f} tok/s; "
            f"aggregate / ({args.shards} x single) = {report['scaling_ratio']:.3f}"
        )
    m = report["multi"]
    ok = (
        m["samples"] == m["samples_unique"] == n
        and m["batch_files"] == m["batches_planned"]
        and m["staging_left"] == 0
        and m["resume_rc"] == 0
    )
    print(
        f"exactly-once after kill + resume: {'yes' if ok else 'NO'} ({m['samples']} samples, "
        f"{m['batch_files']}/{m['batches_planned']} batch files, {m['staging_left']} left in staging)"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
