"""The kernel warm-up of a run: skipped when the kernel cache covers the plan, else run beside the weight load.

``open_kernel_cache`` picks the run's kernel cache (model/kernel_cache.py) and writes the run dir's pointer to it.
``Warmup.start`` starts ``python -m hsextract.model.warmup RUN_DIR`` on the first GPU unless the cache's stamp
already lists every token-count bucket and shape class the plan needs; the launcher starts the workers at the
same time, so the warm-up compiles (CPU) while they load their weights (I/O). A worker started with
``WARMUP_FLAG_ENV`` set waits, after its load and before its first batch, until that file exists
(``wait_for_warmup``): the launcher writes it when the warm-up process ends, however it ends, so shards never
compile the same kernels at once and never wait for a warm-up that is gone.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.model import kernel_cache
from hsextract.model.kernel_cache import KernelCache, WarmSet
from hsextract.model.warmup import fla_available
from hsextract.prepare.plan import Plan
from hsextract.run.procs import die_with_parent
from hsextract.run.rundir import RunDir
from hsextract.storage.fileio import atomic_write

log = logging.getLogger(__name__)


WARMUP_FLAG_ENV = "HSEXTRACT_WARMUP_DONE"


WARMUP_WAIT_S = 1800.0

"""The longest a worker waits for the warm-up before it goes on (and compiles what it meets itself)."""


def open_kernel_cache(cfg: RunConfig) -> KernelCache:
    """The run's kernel cache, created on CUDA (on CPU nothing is compiled, so nothing is made), and the run
    dir's pointer naming it."""
    kc = kernel_cache.resolve(cfg.kernel_cache, cfg.device)
    if cfg.device == "cuda":
        try:
            kernel_cache.prepare(kc)
        except HsextractError:
            if kc.source != "default":
                raise
            # A home directory that cannot be written (some cluster nodes): the run dir, as before, for this job.
            log.warning("kernel cache %s cannot be written; using the run dir's", kc.dir)
            kc = KernelCache(RunDir(cfg.run_dir).root.absolute() / "kernel-cache", kc.key, "run dir")
            kernel_cache.prepare(kc)
    kernel_cache.write_pointer(RunDir(cfg.run_dir).kernel_cache_pointer, kc)
    return kc


def warm_missing(cfg: RunConfig, plan: Plan, cache_dir: Path) -> WarmSet:
    """What the plan needs warmed that the cache's stamp does not list (empty: the warm-up can be skipped)."""
    from hsextract.model.load import load_model_config

    _, text, _ = load_model_config(cfg.model)
    need = kernel_cache.plan_needs(plan.batches, kernel_cache.bucket_heads(text, cfg.kernel_mode))
    return need.minus(kernel_cache.read_stamp(cache_dir, kernel_cache.run_signature(cfg, text)))


class Warmup:
    """The warm-up process of a run, started beside the workers. ``poll`` from the launcher's loop writes the
    flag the workers wait for once the process has ended, and says how it went."""

    def __init__(self, proc: subprocess.Popen, flag: Path, log_file: Path, echo):
        self.proc, self.flag, self.log_file, self.echo = proc, flag, log_file, echo
        self.t0 = time.time()
        self.finished = False

    @classmethod
    def start(cls, cfg: RunConfig, plan: Plan, kc: KernelCache, echo=print) -> Warmup | None:
        """The started warm-up, or None when it is not needed (the stamp covers the plan) or cannot help."""
        if not fla_available():
            echo(
                "flash-linear-attention is not installed: Gated-DeltaNet layers run the slow torch path "
                "(pip install -e .[gpu])"
            )
            return None
        missing = warm_missing(cfg, plan, kc.dir)
        if not missing:
            echo(f"kernel cache {kc.dir} holds every kernel this plan needs: pre-warm skipped")
            return None
        run_dir = RunDir(cfg.run_dir)
        run_dir.warmup_done_file.unlink(missing_ok=True)
        env = {"TRITON_CACHE_AUTOTUNING": "1", **os.environ, "TRITON_CACHE_DIR": str(kc.dir)}
        env["CUDA_VISIBLE_DEVICES"] = str((cfg.gpus or (0,))[0])
        log_file = run_dir.log_file(0, "warmup")
        log_file.parent.mkdir(parents=True, exist_ok=True)
        echo(
            f"pre-warming kernels into {kc.dir} ({len(missing.buckets)} token-count bucket(s), "
            f"{len(missing.classes)} shape class(es) new) while the shards load"
        )
        parent = os.getpid()
        with open(log_file, "ab") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hsextract.model.warmup", str(run_dir.root)],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: die_with_parent(parent),
            )
        return cls(proc, run_dir.warmup_done_file, log_file, echo)

    def worker_env(self) -> dict[str, str]:
        return {WARMUP_FLAG_ENV: str(self.flag)}

    def poll(self) -> bool:
        """True once the process has ended (the flag is then written)."""
        if self.finished:
            return True
        rc = self.proc.poll()
        if rc is None:
            return False
        self._finish()
        if rc == 0:
            self.echo(f"kernels warm in {time.time() - self.t0:.0f} s")
        else:
            self.echo(f"warm-up failed (exit {rc}, see {self.log_file}); shards compile themselves")
        return True

    def stop(self) -> None:
        """End the warm-up (the run stops, or every worker has exited)."""
        if self.finished:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._finish()

    def _finish(self) -> None:
        self.finished = True
        atomic_write(self.flag, f"{self.proc.returncode}\n")


def warmup_pending(env=None) -> bool:
    """In a worker: a warm-up was started beside it (its flag may already be written)."""
    return bool((os.environ if env is None else env).get(WARMUP_FLAG_ENV))


def wait_for_warmup(env=None, timeout: float = WARMUP_WAIT_S, poll_s: float = 0.2) -> float | None:
    """In a worker: wait until the warm-up's flag file exists (or ``timeout``); the seconds waited, or None when
    no warm-up runs for this worker. A stop signal interrupts the sleep (``Terminated``)."""
    flag = (os.environ if env is None else env).get(WARMUP_FLAG_ENV)
    if not flag:
        return None
    t0 = time.monotonic()
    while not Path(flag).exists():
        if time.monotonic() - t0 > timeout:
            log.warning("the kernel warm-up is not done after %.0f s: going on without it", timeout)
            break
        time.sleep(poll_s)
    waited = time.monotonic() - t0
    log.info("waited %.1f s for the kernel warm-up", waited)
    return waited
