"""The real command, ``hsextract run``, timed as users meet it: to its first durable batch cold, warm and on resume;
to its end (steady state); with several shards, one killed and resumed.

    python scripts/bench_startup.py --model CKPT --work /tmp/bs [--tokens 300000] [--step-timeout 240]
    python scripts/bench_startup.py --model CKPT --steps shards --shards 4 --gpus 0,1,2,3 --layers 1,4,6
    python scripts/bench_startup.py --device cpu --work /tmp/bs-cpu      # dry run: the demo's tiny model

Steps, each a real ``hsextract run`` subprocess stopped (SIGTERM, a clean stop) once its first batch is
durable, each under ``--step-timeout`` seconds:

  untuned a new job with an empty kernel cache of its own and no autotune tables (``HSEXTRACT_TUNED=0``): every
          kernel compiled and every candidate config timed, as before the tables; its warm-up records the
          table that ``--ship-table`` copies into the package (startup/warmup/tables.py);
  cold    a new job with an empty kernel cache (``--kernel-cache WORK/kernels``, emptied first): a machine that
          never ran hsextract, with the package's shipped autotune table for its GPU;
  warm    a new job (new output and run dir) on the same data, same machine: the kernel cache as cold left it;
  fresh   a new job on new data of the same size (other lengths, so other batch shapes), same kernel cache;
  resume  the warm job's command again: it resumes (staged files uploaded, the rest computed);
  steady  (only when asked) a new job on the same data, run to its end: the steady state of the real command,
          real tokens per second between the batches written after its first two (shard 0's log), and the
          uploader's seconds per file;
  load    (only when asked) ``load_model`` alone in a fresh process per variant (--load-variants): the fast reader
          (HSEXTRACT_FAST_LOAD=1) and a reader thread count (HSEXTRACT_LOAD_THREADS); the runs above load with
          transformers' 4 threads;
  shards  (only when asked) a 1-shard job to its end (the single-shard rate), then a ``--shards`` job on ``--gpus``
          (``0,0,0,0`` shares one GPU: the ratio then measures multi-process overhead, not scaling) whose last
          worker is SIGKILLed once a third of its batches are durable, then resumed: tokens/s per shard, the
          aggregate against N x single, peak host memory of the process tree, the staging high-water mark, and
          exactly-once through the reader (every sample once, every planned batch once, nothing left staged).

For each step: seconds to the first durable batch (its completion record in the output) and to the first batch
computed in that attempt,
and the phases parsed from the launcher's output and the run's logs: preparation, pre-warm (or skipped), model
load, the wait for the warm-up, first batch written after the load, first upload. Every figure is printed on one
line (``figure STEP.NAME VALUE``) and all of them go to ``--json-out``. The data is a pre-tokenized file of the
realistic length mix (scripts/benchlib.py), ``--tokens`` long.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
from benchlib import ROOT, write_token_rows

SRC = ROOT / "src"

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")

WRITTEN = re.compile(r"batch \d+ written: (\d+) rows, (\d+) tokens, ([0-9.]+) MB in ([0-9.]+) s")

"""The worker's line for each batch file it staged (run/worker.py): rows, real tokens, MB, seconds to write."""


UPLOADED = re.compile(r"uploaded \S+: (\d+) bytes in ([0-9.]+) s")

"""The uploader's line for each file it made durable: bytes, seconds."""


def durable(output: Path) -> set[str]:
    """The batches the output records done (its completion records: the one ledger of a finished batch)."""
    root = output / "hsextract" / "done"
    return {str(p.relative_to(root)) for p in root.rglob("*.json")} if root.exists() else set()


def log_lines(path: Path, since: float) -> list[tuple[float, str]]:
    """(epoch seconds, line) of a run log's lines written at or after ``since``."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        m = LOG_TIME.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if t >= since - 1.0:  # the log's clock has millisecond steps
                out.append((t, line))
    return out


def first(lines, pattern: str):
    """(time, match) of the first line matching ``pattern``, or (None, None)."""
    for t, line in lines:
        m = re.search(pattern, line)
        if m:
            return t, m
    return None, None


def phases(run_dir: Path, launcher_out: str, t0: float) -> dict:
    """What the launcher printed and shard 0's logs say about this attempt (started at ``t0``)."""
    got: dict = {}
    m = re.search(r"prepared in ([0-9.]+) s", launcher_out)
    got["prepare_s"] = float(m.group(1)) if m else None
    m = re.search(r"kernels warm in ([0-9.]+) s", launcher_out)
    got["prewarm_s"] = float(m.group(1)) if m else None
    got["prewarm_skipped"] = "pre-warm skipped" in launcher_out
    m = re.search(r"\((\d+) token-count bucket\(s\), (\d+) shape class\(es\) new\)", launcher_out)
    got["prewarm_new_buckets"], got["prewarm_new_classes"] = (int(m[1]), int(m[2])) if m else (None, None)
    got["prewarm_failed"] = "warm-up failed" in launcher_out
    warm_log = run_dir / "logs" / "shard-00000.warmup.log"
    if warm_log.exists() and got["prewarm_s"] is not None:
        reports = [ln for ln in warm_log.read_text(errors="replace").splitlines() if ln.startswith("{")]
        if reports:
            got["prewarm_report"] = json.loads(reports[-1])
    shard = log_lines(run_dir / "logs" / "shard-00000.log", t0)
    t_loaded, m = first(shard, r"model loaded in ([0-9.]+) s")
    got["load_s"] = float(m.group(1)) if m else None
    got["loaded_at_s"] = t_loaded - t0 if t_loaded else None
    _, m = first(shard, r"waited ([0-9.]+) s for the kernel warm-up")
    got["kernel_wait_s"] = float(m.group(1)) if m else 0.0
    t_written, m = first(shard, WRITTEN)
    got["first_batch_written_at_s"] = t_written - t0 if t_written else None
    got["first_batch_after_load_s"] = t_written - t_loaded if t_written and t_loaded else None
    got["first_batch_write_s"] = float(m.group(4)) if m else None
    uploads = log_lines(run_dir / "logs" / "shard-00000.uploader.log", t0)
    t_up, m = first(uploads, UPLOADED)
    got["first_upload_s"] = float(m.group(2)) if m else None
    got["first_upload_bytes"] = int(m.group(1)) if m else None
    got["first_uploaded_at_s"] = t_up - t0 if t_up else None
    return got


def steady_state(run_dir: Path, since: float, skip: int = 2) -> dict:
    """Shard 0's rhythm once running: real tokens per second between the batches written after its first ``skip``
    (first-call costs stay out), and the uploader's seconds per file."""
    written = []
    for t, line in log_lines(run_dir / "logs" / "shard-00000.log", since):
        if m := WRITTEN.search(line):
            written.append((t, int(m.group(2)), float(m.group(3)), float(m.group(4))))
    uploads = [
        float(m.group(2))
        for _, line in log_lines(run_dir / "logs" / "shard-00000.uploader.log", since)
        if (m := UPLOADED.search(line))
    ]
    got: dict = {"batches_written": len(written), "tokens_written": sum(w[1] for w in written)}
    if len(written) > skip + 1:
        later = written[skip:]
        span = later[-1][0] - later[0][0]
        got["steady_batches"] = len(later) - 1
        got["steady_tokens_per_s"] = round(sum(w[1] for w in later[1:]) / span, 1) if span > 0 else None
        got["write_s_median"] = round(float(np.median([w[3] for w in later])), 3)
        got["file_mb_median"] = round(float(np.median([w[2] for w in later])), 1)
    if uploads:
        got["upload_s_median"] = round(float(np.median(uploads)), 2)
        got["upload_s_max"] = round(max(uploads), 2)
    return got


def hsextract_cli(argv: list, stdout, env: dict, start_new_session: bool = False) -> subprocess.Popen:
    """``hsextract ARGV...`` in a child process, its stderr with its stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "hsextract.cli", *map(str, argv)],
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=start_new_session,
    )


def attempt(
    name: str,
    argv: list,
    run_dir: Path,
    output: Path,
    work: Path,
    timeout: float,
    env: dict,
    to_the_end: bool = False,
) -> dict:
    """One ``hsextract run``, stopped once a batch it made durable appears (or, ``to_the_end``, left to finish);
    its figures."""
    before = durable(output)
    out_path = work / f"{name}.out"
    t0 = time.time()
    timeline: list[str] = []  # the launcher's lines, each with the second it arrived after t0

    def collect(stream, out):
        for line in iter(stream.readline, ""):
            out.write(line)
            timeline.append(f"{time.time() - t0:6.2f} {line.rstrip()[:160]}")

    with open(out_path, "w") as out:
        proc = hsextract_cli(argv, subprocess.PIPE, env, start_new_session=True)
        reader = threading.Thread(target=collect, args=(proc.stdout, out), daemon=True)
        reader.start()
        result: dict = {"first_durable_s": None}
        while time.time() - t0 < timeout:
            if result["first_durable_s"] is None and durable(output) - before:
                result["first_durable_s"] = round(time.time() - t0, 2)
                if not to_the_end:
                    break
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        if to_the_end:
            result["finished"] = proc.poll() is not None
            result["wall_s"] = round(time.time() - t0, 2)
        result["timed_out"] = result["first_durable_s"] is None and proc.poll() is None
        stopped = proc.poll() is None
        if stopped:
            proc.send_signal(signal.SIGTERM)  # a clean stop: the next attempt resumes
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=10)
    result["exit_code"] = proc.returncode
    result["stopped_by_bench"] = stopped
    result["new_durable_batches"] = len(durable(output) - before)
    text = out_path.read_text(errors="replace")
    result.update(
        {k: round(v, 2) if isinstance(v, float) else v for k, v in phases(run_dir, text, t0).items()}
    )
    early = re.findall(
        r"started early: imports and CUDA in ([0-9.]+) s, .* \(started at ([0-9.]+)\)",
        (run_dir / "logs" / "shard-00000.stderr.log").read_text(errors="replace")
        if (run_dir / "logs" / "shard-00000.stderr.log").exists()
        else "",
    )
    early = [(float(at), float(took)) for took, at in early if float(at) >= t0 - 1.0]
    if early:
        result["early_started_at_s"] = round(early[-1][0] - t0, 2)
        result["early_ready_at_s"] = round(early[-1][0] + early[-1][1] - t0, 2)
    result["timeline"] = [line for line in timeline if "%|" not in line][:40]
    if result["first_durable_s"] is None:
        result["launcher_tail"] = text[-1500:]
    return result


class TreeSampler(threading.Thread):
    """Peak RSS of a process tree and peak bytes in a staging directory, sampled every 0.2 s."""

    def __init__(self, staging: Path):
        super().__init__(daemon=True)
        self.pid, self.staging = None, staging
        self.peak_rss = self.peak_staging = 0
        self.done = threading.Event()

    def run(self):
        import psutil

        while not self.done.wait(0.2):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                self.peak_rss = max(self.peak_rss, sum(p.memory_info().rss for p in procs if p.is_running()))
            except (psutil.Error, ValueError):
                pass
            staged = 0
            for p in self.staging.rglob("*.safetensors"):
                try:
                    staged += p.stat().st_size
                except FileNotFoundError:
                    pass
            self.peak_staging = max(self.peak_staging, staged)


def shard_job(
    argv: list, run_dir: Path, output: Path, staging: Path, log: Path, env: dict, kill_shard: int | None
):
    """One job to its end; with ``kill_shard``, that shard's worker is SIGKILLed once a third of its batches are
    durable and the same command run again (the resume)."""
    from hsextract.output import Plan
    from hsextract.run.progress import ShardProgress

    result: dict = {}
    sampler = TreeSampler(staging)
    t0 = time.time()
    with open(log, "a") as out:
        proc = hsextract_cli(argv, out, env)
        sampler.pid = proc.pid
        sampler.start()
        while proc.poll() is None and not durable(output):
            time.sleep(0.1)
        result["first_durable_batch_s"] = round(time.time() - t0, 2) if durable(output) else None
        if kill_shard is not None:
            prefix = f"shard-{kill_shard:05d}/"
            mine = [b for b in Plan.load(run_dir / "plan.json").batches if b.shard == kill_shard]
            while proc.poll() is None:
                done = [k for k in durable(output) if k.startswith(prefix)]
                if len(done) >= max(1, len(mine) // 3):
                    pid = ShardProgress.load(run_dir, kill_shard).pid
                    os.kill(pid, signal.SIGKILL)
                    result["killed"] = {
                        "shard": kill_shard,
                        "pid": pid,
                        "batches_done": len(done),
                        "of": len(mine),
                    }
                    break
                time.sleep(0.05)
        result["first_attempt_rc"] = proc.wait()
        result["first_attempt_s"] = round(time.time() - t0, 2)
        if kill_shard is not None:
            t1 = time.time()
            proc = hsextract_cli(argv, out, env)
            sampler.pid = proc.pid
            result["resume_rc"] = proc.wait()
            result["resume_s"] = round(time.time() - t1, 2)
    sampler.done.set()
    sampler.join()
    result["wall_s"] = round(time.time() - t0, 2)
    result["peak_host_rss_gb"] = round(sampler.peak_rss / 1e9, 2)
    result["staging_high_water_gb"] = round(sampler.peak_staging / 1e9, 2)
    plan = Plan.load(run_dir / "plan.json")
    result["tokens_per_s_per_shard"] = [
        round(ShardProgress.load(run_dir, s).tokens_per_s, 1) for s in range(plan.shards)
    ]
    return result


def shards_step(job_args, shards: int, gpus: str, rows: int, work: Path, env: dict) -> dict:
    """A 1-shard job for the single-shard rate, then a ``shards`` job with one worker killed and resumed; the
    scaling ratio and exactly-once through the reader. Both run to their end (no step timeout)."""
    from hsextract.output import Plan, open_output

    env = {**env, "TRITON_CACHE_DIR": str(work / "kernels")}  # both jobs share one kernel cache
    report: dict = {}
    for job, n, job_gpus in (("single", 1, gpus.split(",")[0]), ("multi", shards, gpus)):
        argv, run_dir, output = job_args(job, n, job_gpus)
        staging = Path(argv[argv.index("--staging") + 1])
        kill = shards - 1 if job == "multi" else None
        report[job] = shard_job(argv, run_dir, output, staging, work / f"{job}.out", env, kill)
        print(f"figure shards.{job} {json.dumps(report[job])}", flush=True)
        if job == "single":  # only its rate is needed: its output goes, to keep /dev/shm free
            shutil.rmtree(output, ignore_errors=True)
    m = report["multi"]
    single = report["single"]["tokens_per_s_per_shard"][0]
    aggregate = sum(m["tokens_per_s_per_shard"])
    report["scaling_ratio"] = round(aggregate / (shards * single), 3) if single else None
    # Exactly once: every sample id once across the output, every planned batch once, nothing left staged.
    ids = open_output(str(output)).sample_ids()
    check = {
        "samples": len(ids),
        "unique": len(set(ids)),
        "rows": rows,
        "batch_files": len(list(output.glob("shard-*/*.safetensors"))),
        "planned": len(Plan.load(run_dir / "plan.json").batches),
        "left_in_staging": len(list(staging.rglob("*.safetensors"))),
    }
    report["check"] = check
    report["exactly_once"] = (
        check["samples"] == check["unique"] == rows
        and check["batch_files"] == check["planned"]
        and check["left_in_staging"] == 0
        and m.get("resume_rc") == 0
    )
    print(
        f"single shard {single:,.0f} tok/s; {shards} shards aggregate {aggregate:,.0f} tok/s; aggregate / "
        f"({shards} x single) = {report['scaling_ratio']}; exactly once after kill + resume: "
        f"{'yes' if report['exactly_once'] else 'NO'} {check}",
        flush=True,
    )
    return report


LOAD_PROBE = """
import cProfile, io, json, logging, os, pstats, sys, time
t_start = time.perf_counter()
import torch, transformers
from hsextract.model.load import load_model
from hsextract.startup import fast_load
t_imports = time.perf_counter() - t_start
seen = []
handler = logging.Handler()
handler.emit = lambda record: seen.append(record.getMessage())
logging.getLogger("hsextract").addHandler(handler)
logging.getLogger("hsextract").setLevel(logging.INFO)
profile = cProfile.Profile() if os.environ.get("BENCH_LOAD_PROFILE") else None
t0 = time.perf_counter()
if profile:
    profile.enable()
lm = load_model(sys.argv[1], dtype=sys.argv[2], device=sys.argv[3], fast_load=fast_load)
if sys.argv[3] != "cpu":
    torch.cuda.synchronize()
s = round(time.perf_counter() - t0, 2)
top = None
if profile:
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
    top = text.getvalue()[-6000:]
fast = [m for m in seen if m.startswith("fast load")]
print(json.dumps({"s": s, "imports_s": round(t_imports, 2), "fast": fast[0] if fast else None, "profile": top}))
"""


def time_loads(model: Path, device: str, dtype: str, variants: list[str], timeout: float, env: dict) -> dict:
    """Seconds ``load_model`` takes in a fresh process per variant: a number of reader threads
    (HSEXTRACT_LOAD_THREADS), or ``fast`` (HSEXTRACT_FAST_LOAD=1: startup/fastload.py; its log line says whether it
    was used or fell back)."""
    out: dict = {}
    t0 = time.time()
    for variant in variants:
        left = timeout - (time.time() - t0)
        if left < 10:
            break
        if variant in ("fast", "profile"):
            extra = {
                "HSEXTRACT_FAST_LOAD": "1",
                **({"BENCH_LOAD_PROFILE": "1"} if variant == "profile" else {}),
            }
            name = variant
        else:  # transformers' reader with that many threads
            extra = {"HSEXTRACT_FAST_LOAD": "0", "HSEXTRACT_LOAD_THREADS": variant}
            name = f"threads_{variant}"
        dev = "cuda:0" if device == "cuda" else "cpu"
        try:
            r = subprocess.run(
                [sys.executable, "-c", LOAD_PROBE, str(model), dtype, dev],
                env={**env, **extra},
                capture_output=True,
                text=True,
                timeout=left,
            )
        except subprocess.TimeoutExpired:
            out[f"{name}_s"] = "timeout"
            break
        lines = r.stdout.strip().splitlines()
        if r.returncode != 0 or not lines:
            out[f"{name}_s"] = r.stderr[-300:]
            continue
        got = json.loads(lines[-1])
        out[f"{name}_s"] = got["s"]
        out[f"{name}_imports_s"] = got["imports_s"]
        if variant in ("fast", "profile"):
            out[f"{name}_log"] = got["fast"]
        if got.get("profile"):
            print(f"--- load profile (cumulative):\n{got['profile']}", flush=True)
    return out


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    info = {}
    for dist in ("torch", "transformers", "triton", "fla-core", "liger-kernel"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,power.limit", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = None
    return info


def print_figures(step: str, result: dict) -> None:
    for key, value in result.items():
        if isinstance(value, dict):
            for k, v in value.items():
                print(f"figure {step}.{key}.{k} {json.dumps(v)}", flush=True)
        elif key != "launcher_tail":
            print(f"figure {step}.{key} {json.dumps(value)}", flush=True)
    if "launcher_tail" in result:
        print(
            f"--- {step}: no durable batch; the launcher's last output:\n{result['launcher_tail']}",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", help="checkpoint (scripts/make_checkpoint.py); default on CPU: the demo's tiny model"
    )
    ap.add_argument("--work", default="/tmp/hsextract-startup")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tokens", type=int, help="tokens of data (default 300,000 on CUDA, 20,000 on CPU)")
    ap.add_argument("--layers", default="dflash")
    ap.add_argument("--max-tokens-per-batch", type=int)
    ap.add_argument("--max-length", type=int)
    ap.add_argument(
        "--compute", choices=["auto", "fp8", "bf16"], help="the jobs' --compute (default: theirs)"
    )
    ap.add_argument(
        "--output-root", help="where outputs and staging go (default /dev/shm on CUDA, --work on CPU)"
    )
    ap.add_argument(
        "--staging-max-gb", type=float, default=8.0, help="small: staging shares RAM with the page cache"
    )
    ap.add_argument(
        "--steps",
        default="cold,warm,resume",
        help="of untuned, cold, warm, fresh, resume, steady, load, shards",
    )
    ap.add_argument("--shards", type=int, default=4, help="shards step: the shards of its second job")
    ap.add_argument("--gpus", default="0,1,2,3", help="shards step: its second job's --gpus")
    ap.add_argument(
        "--ship-table",
        help="after the untuned step, copy the autotune table its warm-up recorded here (the shipped table)",
    )
    ap.add_argument(
        "--load-variants", default="fast,16", help="load step: 'fast' and/or reader thread counts to time"
    )
    ap.add_argument("--step-timeout", type=float, default=240.0, help="seconds each step may take")
    ap.add_argument(
        "--total-timeout", type=float, help="seconds all steps together may take (a step gets the rest)"
    )
    ap.add_argument("--json-out")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.model:
        model = Path(args.model)
    elif cpu:
        from hsextract.demo import build_model

        model = build_model(work / "tiny-model")
    else:
        ap.error("--model is required on CUDA (scripts/make_checkpoint.py configs/qwen3.6-27b DIR)")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(model)))
    batch = args.max_tokens_per_batch or (2048 if cpu else 65536)
    max_length = args.max_length or min(batch, 512 if cpu else 4096)
    tokens = args.tokens or (20_000 if cpu else 300_000)
    data = work / "data.jsonl"
    rows = write_token_rows(data, tokens, vocab, max_length)
    out_root = Path(args.output_root or (work if cpu else "/dev/shm")) / "hsextract-bench-startup"
    shutil.rmtree(out_root, ignore_errors=True)
    kernels = work / "kernels"  # empty: the cold start
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    report: dict = {
        "machine": machine(),
        "model": str(model),
        "device": args.device,
        "rows": rows,
        "tokens": tokens,
        "max_tokens_per_batch": batch,
    }
    print(f"figure setup {json.dumps(report)}", flush=True)

    fresh_data = work / "fresh-data.jsonl"
    if "fresh" in args.steps.split(","):
        write_token_rows(fresh_data, tokens, vocab, max_length, seed=1)  # other lengths: other batch shapes

    def job_args(job: str, shards: int = 1, gpus: str | None = None) -> tuple[list, Path, Path]:
        run_dir, output = work / f"{job}-run", out_root / f"{job}-out"
        job_data = fresh_data if job == "fresh" else data
        argv = ["run", "--model", model, "--data", job_data, "--output", output]
        job_kernels = work / "kernels-untuned" if job == "untuned" else kernels
        argv += [
            "--run-dir",
            run_dir,
            "--staging",
            out_root / f"{job}-staging",
            "--kernel-cache",
            job_kernels,
        ]
        argv += [
            "--layers",
            args.layers,
            "--device",
            args.device,
            "--dtype",
            "float32" if cpu else "bfloat16",
        ]
        argv += ["--max-tokens-per-batch", batch, "--max-length", max_length, "--no-progress"]
        argv += ["--staging-max-gb", args.staging_max_gb, "--shards", shards]
        if gpus and not cpu:
            argv += ["--gpus", gpus]
        if args.compute:
            argv += ["--compute", args.compute]
        return argv, run_dir, output

    # the job each step runs
    steps = {
        "untuned": "untuned",
        "cold": "cold",
        "warm": "warm",
        "fresh": "fresh",
        "resume": "warm",
        "steady": "steady",
    }
    t_all = time.time()
    for step in args.steps.split(","):
        limit = args.step_timeout
        if args.total_timeout:
            limit = min(limit, args.total_timeout - (time.time() - t_all))
        if limit < 10:
            print(f'figure {step}.skipped "no time left"', flush=True)
            continue
        if step == "load":
            dtype = "float32" if cpu else "bfloat16"
            variants = args.load_variants.split(",")
            report[step] = result = time_loads(model, args.device, dtype, variants, limit, env)
            print_figures(step, result)
            continue
        if step == "shards":
            report[step] = result = shards_step(job_args, args.shards, args.gpus, rows, work, env)
            print_figures(step, result)
            continue
        argv, run_dir, output = job_args(steps[step])
        step_env = {**env, "HSEXTRACT_TUNED": "0"} if step == "untuned" else env
        t_step = time.time()
        result = attempt(step, argv, run_dir, output, work, limit, step_env, to_the_end=step == "steady")
        if step == "steady":
            result.update(steady_state(run_dir, t_step))
        report[step] = result
        recorded = (
            next(iter(sorted((work / "kernels-untuned").glob("*/hsextract-tuned.json"))), None)
            if step == "untuned" and args.ship_table
            else None
        )
        if recorded is not None:
            # What this machine's first warm-up chose: the table shipped for this GPU (startup/warmup/tables.py).
            Path(args.ship_table).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(recorded, args.ship_table)
            print(f"figure untuned.table {json.dumps(str(args.ship_table))}", flush=True)
        print_figures(step, result)
        # Done with the cold job: its output and staging go, to keep /dev/shm (and the page cache) free.
        for leftover in (
            "untuned-out",
            "untuned-staging",
            "cold-out",
            "cold-staging",
            "fresh-out",
            "fresh-staging",
            "steady-out",
            "steady-staging",
            "single-out",
            "single-staging",
            "multi-out",
            "multi-staging",
        ):
            shutil.rmtree(out_root / leftover, ignore_errors=True)
        if args.json_out:  # after every step: a later one cut short keeps the earlier figures
            Path(args.json_out).write_text(json.dumps(report, indent=1))
    report["total_s"] = round(time.time() - t_all, 1)
    print(f"figure total_s {report['total_s']}", flush=True)
    shutil.rmtree(out_root, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    jobs = [s for s in args.steps.split(",") if s not in ("load", "shards")]
    ok = all(report.get(s, {}).get("first_durable_s") is not None for s in jobs)
    ok = ok and report.get("shards", {}).get("exactly_once", True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
