"""Run the shards of a prepared run (prepare.py) to completion, then finish the output.

``launch`` starts one worker process per shard (``hsextract.worker.main`` with RUN_DIR SHARD) with
``CUDA_VISIBLE_DEVICES`` set before torch is imported there, and a parent-death signal so a killed launcher takes
its workers with it. On GPUs it first pre-warms flash-linear-attention's kernels into the run's shared Triton
cache (warmup.py). It draws a progress bar per shard from the progress files, waits for every worker, and exits
non-zero naming each failed shard and its log. When every planned batch has a marker, ``finalize`` writes the
manifest to the output, last: an output with a manifest is complete.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time

from .config import RunConfig
from .data import TokenizedSamples
from .errors import HsextractError
from .output import STORED_FIELDS, build_manifest, write_manifest
from .plan import Plan
from .procs import die_with_parent
from .progress import ShardProgress
from .rundir import RunDir, RunInfo, atomic_write
from .storage import open_sink


def _die_with_launcher():
    """``preexec_fn`` for a child of this launcher: it dies with the launcher, even one killed mid-fork."""
    return functools.partial(die_with_parent, os.getpid())


def start_worker(cfg: RunConfig, shard: int) -> subprocess.Popen:
    run_dir = RunDir(cfg.run_dir)
    env = dict(os.environ)
    if cfg.device == "cuda":
        gpus = cfg.gpus or tuple(range(cfg.shards))
        env["CUDA_VISIBLE_DEVICES"] = str(gpus[shard])
    else:
        # CPU shards share the host's cores. Each torch would start one OpenMP thread per core, and more threads
        # than cores make every small op wait on spinning threads (measured: a 300-token forward of the tiny model
        # 0.02 s with 1 thread, 0.05-2.5 s with 2 threads per process on 2 cores).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // cfg.shards)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # One Triton cache for every process of the run: kernels compiled once (by the warm-up) serve all shards.
    env.setdefault("TRITON_CACHE_DIR", str(run_dir.triton_cache))
    out = run_dir.log_file(shard, "stderr")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not `-m hsextract.worker`: the worker starts its uploader with `spawn`, which re-imports the parent's __main__
    # module in the child, and that module imports torch. A `-c` program leaves the child nothing to re-import.
    entry = "import sys; from hsextract.worker import main; sys.exit(main())"
    with open(out, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-c", entry, str(run_dir.root), str(shard)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_launcher(),
        )


def prewarm(cfg: RunConfig, echo=print) -> None:
    """Compile flash-linear-attention's kernels once into the shared Triton cache before the shards start."""
    from .warmup import fla_available

    if not fla_available():
        echo(
            "flash-linear-attention is not installed: Gated-DeltaNet layers run the slow torch path "
            "(pip install -e .[gpu])"
        )
        return
    run_dir = RunDir(cfg.run_dir)
    env = dict(os.environ)
    env.setdefault("TRITON_CACHE_DIR", str(run_dir.triton_cache))
    env["CUDA_VISIBLE_DEVICES"] = str((cfg.gpus or (0,))[0])
    t0 = time.time()
    echo("pre-warming flash-linear-attention kernels into the shared Triton cache ...")
    log = run_dir.log_file(0, "warmup")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        r = subprocess.run(
            [sys.executable, "-m", "hsextract.warmup", str(run_dir.root)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_launcher(),
        )
    if r.returncode == 0:
        echo(f"kernels warm in {time.time() - t0:.0f} s")
    else:
        echo(f"warm-up failed (exit {r.returncode}, see {log}); shards compile themselves")


def launch(cfg: RunConfig, plan: Plan, *, only_shards=None, show_progress: bool = True, echo=print) -> int:
    """Run the shards to completion; returns the process exit code."""
    run_dir = RunDir(cfg.run_dir)
    shards = sorted(only_shards) if only_shards else list(range(cfg.shards))
    bad = [s for s in shards if not 0 <= s < cfg.shards]
    if bad:
        raise HsextractError(f"--only-shards {bad}: this run has shards 0..{cfg.shards - 1}")
    done = run_dir.done_keys()
    todo = [s for s in shards if any(b.key not in done for b in plan.for_shard(s))]
    if len(todo) < len(shards):
        echo(f"shards already complete: {sorted(set(shards) - set(todo))}")
    if todo and cfg.device == "cuda" and cfg.prewarm:
        prewarm(cfg, echo=echo)
    procs = {s: start_worker(cfg, s) for s in todo}
    bars = _Bars(run_dir, plan, todo, enabled=show_progress)
    failed: dict[int, int] = {}
    try:
        while procs:
            for s, p in list(procs.items()):
                rc = p.poll()
                if rc is not None:
                    del procs[s]
                    if rc != 0:
                        failed[s] = rc
            bars.update()
            time.sleep(0.25)
    finally:
        bars.close()
    for s, rc in sorted(failed.items()):
        prog = ShardProgress.load(run_dir, s)
        if prog and prog.state == "failed" and prog.error:
            why = f": {prog.error}"
        else:  # died before it could record why (or refused to touch the progress file): its last words
            why = _last_line(run_dir.log_file(s, "stderr"))
            why = f": {why}" if why else ""
        echo(
            f"shard {s} failed ({_exit_reason(rc)}){why}\n  log: {run_dir.log_file(s)}\n"
            f"  output: {run_dir.log_file(s, 'stderr')}"
        )
    if failed:
        echo("Rerun the same command to resume: finished batches are kept.")
        return 1
    return finalize(cfg, plan, echo=echo)


def _last_line(path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _exit_reason(returncode: int) -> str:
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    # SIGKILL that no one sent by hand is most often the kernel's out-of-memory killer.
    return f"killed by {name}" + (", out of host memory?" if name == "SIGKILL" else "")


def finalize(cfg: RunConfig, plan: Plan, echo=print) -> int:
    """Write the manifest once every planned batch is durable. The manifest goes last."""
    run_dir = RunDir(cfg.run_dir)
    done = run_dir.done_keys()
    missing = [b.key for b in plan.batches if b.key not in done]
    if missing:
        echo(
            f"{len(missing)} of {len(plan.batches)} batches still to do (other shards); no manifest written yet"
        )
        return 0
    manifest = build_manifest(
        info=RunInfo.load(run_dir),
        plan=plan,
        dtype=cfg.dtype,
        sample_ids=TokenizedSamples.load(run_dir.tokens_file).sample_ids,
        data_report=json.loads(run_dir.data_report_file.read_text()),
        stored=_stored_records(run_dir, plan),
    )
    write_manifest(open_sink(cfg.output, cfg.s3_endpoint_url), manifest)
    atomic_write(run_dir.complete_file, plan.plan_hash)
    echo(
        f"done: {plan.num_samples} samples, {plan.num_tokens} tokens in {len(plan.batches)} batch files at {cfg.output}"
    )
    return 0


def _stored_records(run_dir: RunDir, plan: Plan) -> dict[str, dict]:
    """What the uploaders' markers recorded of each batch file (size, CRC32, header checksum), for the manifest."""
    stored, unusable = {}, []
    for b in plan.batches:
        try:
            record = json.loads(run_dir.marker(b.key).read_text())
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and all(isinstance(record.get(f), t) for f, t in STORED_FIELDS.items()):
            stored[b.key] = record
        else:
            unusable.append(str(run_dir.marker(b.key)))
    if unusable:
        raise HsextractError(
            f"{len(unusable)} marker(s) are unreadable or lack the file's checksums (written by an older "
            f"hsextract?): {', '.join(unusable[:3])}{' ...' if len(unusable) > 3 else ''}. Delete them and rerun "
            "to recompute those batches"
        )
    return stored


class _Bars:
    """One tqdm bar per shard, fed from the progress files the workers write."""

    def __init__(self, run_dir: RunDir, plan: Plan, shards, enabled: bool):
        self.run_dir, self.shards, self.bars = run_dir, shards, {}
        if not enabled:
            return
        from tqdm import tqdm

        # On a terminal the bars redraw in place; in a log file a line every 30 s is plenty.
        interval = 0.5 if sys.stderr.isatty() else 30.0
        for pos, s in enumerate(shards):
            total = sum(b.num_tokens for b in plan.for_shard(s))
            self.bars[s] = tqdm(
                total=total,
                desc=f"shard {s}",
                unit="tok",
                unit_scale=True,
                position=pos,
                dynamic_ncols=True,
                leave=True,
                mininterval=interval,
            )
        self.seen = {s: (0, "") for s in shards}

    def update(self) -> None:
        for s, bar in self.bars.items():
            p = ShardProgress.load(self.run_dir, s)
            if p is None or (p.tokens_done, p.state) == self.seen[s]:
                continue
            self.seen[s] = (p.tokens_done, p.state)
            bar.set_postfix_str(f"{p.state} {p.tokens_per_s:,.0f} tok/s", refresh=False)
            bar.update(p.tokens_done - bar.n)

    def close(self) -> None:
        self.update()
        for bar in self.bars.values():
            bar.close()
