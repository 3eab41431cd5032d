"""The launcher's side of start-up: ``begin`` once the places are checked, then ``Startup.start_workers``.

Every worker process starts one way (``start_worker``), whether early, while the data is prepared (early.py), or
once the plan is ready; an early one is handed its shard through its go file. Beside the workers' weight load the
kernel warm-up runs (warmup/launch.py), unless the kernel cache already holds what the plan needs.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from hsextract.config import RunConfig
from hsextract.output import Plan
from hsextract.startup.early import early_env, prestart_enabled
from hsextract.startup.files import StartupFiles
from hsextract.startup.warmup import KernelCache, Warmup, WarmupSpec, open_kernel_cache
from hsextract.storage.fileio import atomic_write

log = logging.getLogger(__name__)


def begin(cfg: RunConfig, files: StartupFiles, *, program: str, preexec_fn=None, shards=None) -> Startup:
    """Start-up for this node's shards, begun once the places are checked (before the model's config is read): on
    CUDA the early workers start now. ``program`` is the worker's (``python -c``), ``preexec_fn`` runs in every
    child (the launcher's die-with-parent). Use it as a context: at its end the early workers not taken are let
    go and the warm-up is ended."""
    startup = Startup(cfg, files, program=program, preexec_fn=preexec_fn, shards=shards)
    if prestart_enabled(cfg):
        startup.start_early()
    return startup


class Startup:
    """The kernel cache, the early workers and the warm-up of one run on this node."""

    def __init__(self, cfg: RunConfig, files: StartupFiles, *, program: str, preexec_fn=None, shards=None):
        self.cfg, self.files, self.program, self.preexec_fn = cfg, files, program, preexec_fn
        self.shards = list(cfg.local_shards if shards is None else shards)
        """The shards this run owns (``--only-shards``, else the node's): only theirs are started early."""
        self.early: dict[int, subprocess.Popen] = {}
        self.warm: Warmup | None = None

    def kernel_cache(self) -> KernelCache:
        """The run's kernel cache, and the run dir's pointer naming it."""
        cfg, files = self.cfg, self.files
        return open_kernel_cache(cfg.kernel_cache, cfg.device, files.root, files.kernel_cache_pointer)

    def start_early(self) -> None:
        """One worker per local shard, started before the plan is ready; it imports, then waits for its go."""
        kernel_dir = self.kernel_cache().dir
        for shard in self.shards:
            go = self.files.go_file(shard)
            go.parent.mkdir(parents=True, exist_ok=True)
            go.unlink(missing_ok=True)
            self.early[shard] = self._start(shard, kernel_dir, early_env(self.cfg, go))
        log.info("started %d worker(s) early, while the data is prepared", len(self.early))

    def start_workers(self, plan: Plan, shards: list[int], echo=print) -> dict[int, subprocess.Popen]:
        """The workers of ``shards``: on CUDA the warm-up started beside their load (when the run pre-warms and the
        cache lacks what the plan needs), the early ones told to run, the others started; the early workers of
        shards with nothing to do let go."""
        kc = self.kernel_cache()
        self.stop_warmup()  # a round before this one's
        warm = shards and self.cfg.device == "cuda" and self.cfg.prewarm
        self.warm = start_warmup(self.cfg, plan, kc, self.files, echo, self.preexec_fn) if warm else None
        env = self.warm.worker_env() if self.warm else {}
        early = {s: self._take(s, env) for s in shards}
        self.release()
        return {s: early[s] or self._start(s, kc.dir, env) for s in shards}

    def poll(self, echo=None) -> None:
        """From the launcher's loop: once the warm-up has ended, its flag written for the workers and its end said
        (with ``echo`` if given)."""
        if self.warm:
            if echo is not None:
                self.warm.echo = echo
            self.warm.poll()

    def stop_warmup(self) -> None:
        if self.warm:
            self.warm.stop()

    def release(self) -> None:
        """Tell every early worker not taken not to run, and end it: it holds nothing but imports and a context."""
        procs, self.early = self.early, {}
        for shard, proc in procs.items():
            try:
                atomic_write(self.files.go_file(shard), json.dumps({"run": False}).encode())
            except OSError:
                pass
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.release()
        self.stop_warmup()

    def __enter__(self) -> Startup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _take(self, shard: int, env: dict[str, str]) -> subprocess.Popen | None:
        """The shard's early worker, told to run as its worker with ``env`` added; None if none was started (or it
        has died: it is then started the usual way)."""
        proc = self.early.pop(shard, None)
        if proc is None:
            return None
        if proc.poll() is not None:
            log.warning("the early worker of shard %d exited (%s); starting it again", shard, proc.returncode)
            return None
        atomic_write(self.files.go_file(shard), json.dumps({"run": True, "env": env}).encode())
        return proc

    def _start(self, shard: int, kernel_dir: Path, env: dict[str, str]) -> subprocess.Popen:
        return start_worker(
            self.cfg,
            shard,
            run_dir=self.files.root,
            program=self.program,
            log_file=self.files.log_file(shard, "stderr"),
            kernel_dir=kernel_dir,
            extra_env=env,
            preexec_fn=self.preexec_fn,
        )


def start_worker(
    cfg: RunConfig,
    shard: int,
    *,
    run_dir: Path,
    program: str,
    log_file: Path,
    kernel_dir: Path | None = None,
    extra_env: dict | None = None,
    preexec_fn=None,
) -> subprocess.Popen:
    """The worker process of ``shard`` (``program`` with the run dir and the shard as arguments), its output appended
    to ``log_file``: its GPU chosen before torch is imported there, ``kernel_dir`` the run's kernel cache (Triton's
    cache directory), ``extra_env`` what else it needs (the warm-up's flag; an early worker's go file)."""
    env = {**os.environ, **cfg.child_env(), **(extra_env or {})}
    if cfg.device == "cuda":
        gpus = cfg.gpus or tuple(range(cfg.shards))
        env["CUDA_VISIBLE_DEVICES"] = str(gpus[shard - cfg.local_shards[0]])
    else:
        # CPU shards share the host's cores. Each torch would start one OpenMP thread per core, and more threads
        # than cores make every small op wait on spinning threads (measured: a 300-token forward of the tiny model
        # 0.02 s with 1 thread, 0.05-2.5 s with 2 threads per process on 2 cores).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // cfg.shards)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # One Triton cache for every process of every job on the machine: kernels compiled once serve all shards.
    if kernel_dir is not None:
        env["TRITON_CACHE_DIR"] = str(kernel_dir)
        env.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # a kernel no table answers is timed once per machine
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-c", program, str(run_dir), str(shard)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )


def warmup_spec(cfg: RunConfig, plan: Plan) -> WarmupSpec:
    """What the kernel warm-up compiles for: the run's model and kernels, the plan's batch shapes, its first GPU."""
    return WarmupSpec(
        model=str(cfg.model_path),
        kernel_mode=cfg.kernel_mode,
        dtype=cfg.dtype,
        attn_implementation=cfg.attn_implementation,
        shapes=tuple((b.rows, b.padded_length) for b in plan.batches),
        gpu=(cfg.gpus or (0,))[0],
    )


def start_warmup(
    cfg: RunConfig, plan: Plan, kc: KernelCache, files: StartupFiles, echo=print, preexec_fn=None
) -> Warmup | None:
    """The kernel warm-up beside the workers' load, or None when the kernel cache covers the plan."""
    return Warmup.start(
        warmup_spec(cfg, plan),
        kc,
        spec_file=files.warmup_spec_file,
        flag=files.warmup_done_file,
        log_file=files.warmup_log,
        echo=echo,
        preexec_fn=preexec_fn,
    )
