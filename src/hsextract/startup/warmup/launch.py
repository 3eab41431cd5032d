"""The launcher's side of the warm-up: the kernel cache a run uses, and the warm-up process started beside the load.

``Warmup.start`` starts ``python -m hsextract.startup.warmup SPEC`` on the first GPU unless the cache's stamp lists
all the run's batch shapes need, so that it compiles (CPU) while the workers load their weights (I/O). A worker
started with ``WARMUP_FLAG_ENV`` waits, before its first batch, for that flag file, which the launcher writes when
the warm-up process ends however it ends: shards never compile the same kernels at once nor wait for a gone warm-up.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.startup.warmup import cache
from hsextract.startup.warmup.cache import KernelCache, WarmSet
from hsextract.startup.warmup.fla_patch import fla_available
from hsextract.storage.fileio import atomic_write

log = logging.getLogger(__name__)


WARMUP_FLAG_ENV = "HSEXTRACT_WARMUP_DONE"


WARMUP_WAIT_S = 1800.0

"""The longest a worker waits for the warm-up before it goes on (and compiles what it meets itself)."""


def open_kernel_cache(option: str | None, device: str, run_root: Path, pointer: Path) -> KernelCache:
    """The run's kernel cache (``--kernel-cache`` is ``option``), created on CUDA (on CPU nothing is compiled,
    so nothing is made), and the run dir's ``pointer`` naming it."""
    kc = cache.resolve(option, device)
    if device == "cuda":
        try:
            cache.prepare(kc)
        except HsextractError:
            if kc.source != "default":
                raise
            # A home directory that cannot be written (some cluster nodes): the run dir, as before, for this job.
            log.warning("kernel cache %s cannot be written; using the run dir's", kc.dir)
            kc = KernelCache(Path(run_root).absolute() / "kernel-cache", kc.key, "run dir")
            cache.prepare(kc)
    cache.write_pointer(pointer, kc)
    return kc


@dataclass(frozen=True)
class WarmupSpec:
    """What a warm-up compiles for: the run's model and kernels, and the (rows, padded_length) of its batches."""

    model: str
    kernel_mode: str
    dtype: str
    attn_implementation: str
    shapes: tuple[tuple[int, int], ...]
    gpu: int = 0

    def signature(self, text_config) -> str:
        """The stamp's name: the same in the launcher and the warm-up process."""
        return cache.model_signature(
            text_config,
            kernel_mode=self.kernel_mode,
            dtype=self.dtype,
            attn_implementation=self.attn_implementation,
        )

    def missing(self, cache_dir: Path, text_config=None) -> WarmSet:
        """What the shapes need warmed that the cache's stamp does not list (empty: the warm-up can be skipped)."""
        if text_config is None:
            from transformers import AutoConfig

            text_config = AutoConfig.from_pretrained(self.model).get_text_config()
        need = cache.plan_needs(self.shapes, cache.bucket_heads(text_config, self.kernel_mode))
        return need.minus(cache.read_stamp(cache_dir, self.signature(text_config)))

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps({**self.__dict__, "shapes": [list(s) for s in self.shapes]}))

    @classmethod
    def load(cls, path) -> WarmupSpec:
        d = json.loads(Path(path).read_text())
        return cls(**{**d, "shapes": tuple((int(r), int(n)) for r, n in d["shapes"])})


class Warmup:
    """The warm-up process of a run, started beside the workers. ``poll`` from the launcher's loop writes the
    flag the workers wait for once the process has ended, and says how it went."""

    def __init__(self, proc: subprocess.Popen, flag: Path, log_file: Path, echo):
        self.proc, self.flag, self.log_file, self.echo = proc, flag, log_file, echo
        self.t0 = time.time()
        self.finished = False

    @classmethod
    def start(
        cls,
        spec: WarmupSpec,
        kc: KernelCache,
        *,
        spec_file: Path,
        flag: Path,
        log_file: Path,
        echo=print,
        preexec_fn=None,
    ) -> Warmup | None:
        """The started warm-up, or None when it is not needed (the stamp covers the shapes) or cannot help.
        ``flag`` is written when it ends; ``preexec_fn`` runs in the child (the launcher's die-with-parent)."""
        from transformers import AutoConfig

        text_config = AutoConfig.from_pretrained(spec.model).get_text_config()
        if not cache.bucket_heads(text_config, spec.kernel_mode):  # no Gated-DeltaNet layer: nothing to warm
            return None
        if not fla_available():
            echo(
                "flash-linear-attention is not installed: Gated-DeltaNet layers run the slow torch path "
                "(pip install -e .[gpu])"
            )
            return None
        missing = spec.missing(kc.dir, text_config)
        if not missing:
            echo(f"kernel cache {kc.dir} holds every kernel this plan needs: pre-warm skipped")
            return None
        flag.unlink(missing_ok=True)
        spec.save(spec_file)
        env = {"TRITON_CACHE_AUTOTUNING": "1", **os.environ, "TRITON_CACHE_DIR": str(kc.dir)}
        env["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        echo(
            f"pre-warming kernels into {kc.dir} ({len(missing.buckets)} token-count bucket(s), "
            f"{len(missing.classes)} shape class(es) new) while the shards load"
        )
        with open(log_file, "ab") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hsextract.startup.warmup", str(spec_file)],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                preexec_fn=preexec_fn,
            )
        return cls(proc, flag, log_file, echo)

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
