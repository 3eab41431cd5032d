"""One thread that watches a shard while it runs: its ticks, its stalls and its progress file.

Nothing calls back into the worker: the main thread sets ``state``, the staging writer exposes what it does, and
a failure the monitor meets (the uploader died) is kept for the main thread and sets ``stop``, which ends the
pipeline at its next batch. A stall is logged and recorded, never acted on.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from hsextract.output import BatchSpec
from hsextract.run.progress import ShardProgress
from hsextract.run.rundir import RunDir, scan_staging
from hsextract.run.stalls import Stall, same_stall, stall_note, worker_stall

log = logging.getLogger(__name__)


TICK_S = 0.25

REFRESH_S = 0.5

"""The progress file is rewritten when it is this old at a tick, so it is never more than about a second old."""


class ShardMonitor:
    """The shard's progress (``ShardProgress``) and the thread that keeps it current."""

    def __init__(self, run_dir: RunDir, progress: ShardProgress, batches: list[BatchSpec], staging, stop):
        self.run_dir, self.progress, self.staging, self.stop = run_dir, progress, staging, stop
        self.by_key = {b.key: b for b in batches}
        self.done: set[str] = set()
        self.state = progress.state
        """What the main thread is doing (loading, running, draining...); the file says ``waiting-for-uploader``
        instead while the staging writer waits."""
        self.idle_from = time.time()
        """Start of the current stretch in which a batch is expected (running, draining)."""
        self.t_start = time.time()
        self.session_tokens = 0
        self.uploader = None
        self.writer = None
        self.failure: BaseException | None = None
        self._stall: Stall | None = None
        self._saved_at = 0.0
        self._lock = threading.RLock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the main thread asks ----------------------------------------------------------------------------------
    def count_done(self, keys, *, this_session: bool = True) -> None:
        """Count ``keys`` done (found done at resume: not this session's work, which the rate is of)."""
        with self._lock:
            for key in keys:
                if key in self.by_key and key not in self.done:
                    self.done.add(key)
                    b, p = self.by_key[key], self.progress
                    p.batches_done, p.samples_done, p.tokens_done = (
                        p.batches_done + 1,
                        p.samples_done + b.rows,
                        p.tokens_done + b.num_tokens,
                    )
                    p.progress_at = time.time()
                    if this_session:
                        self.session_tokens += b.num_tokens

    @property
    def all_done(self) -> bool:
        return len(self.done) == len(self.by_key)

    def running(self, state: str) -> None:
        """The main thread now expects batches (``running``, ``draining``): a stall is timed from here."""
        self.state, self.idle_from = state, time.time()
        if state == "running":
            self.t_start = self.idle_from  # the rate is of the forwards, not of the load before them

    def check(self) -> None:
        """Raise the failure the monitor met, if any (in the main thread)."""
        if self.failure is not None:
            raise self.failure

    def start(self, uploader, writer) -> None:
        self.uploader, self.writer = uploader, writer
        self._thread = threading.Thread(target=self._loop, name="shard-monitor", daemon=True)
        self._thread.start()

    def halt(self) -> None:
        """Stop the thread (a stall that ended within the last tick is logged as recovered); never raises."""
        if self._thread is not None:
            self._halt.set()
            self._thread.join()
            self._thread = None
            self._check_stall(time.time())

    def save(self, state: str | None = None, *, last: bool = False) -> None:
        """Rewrite the progress file now; ``last``: how the shard ended, saved even on a full run dir if at all
        possible."""
        with self._lock:
            if state:
                self.state = state
            p = self.progress
            waiting = self.writer is not None and self.writer.waiting and self.state == "running"
            p.state = "waiting-for-uploader" if waiting else self.state
            if self.writer is not None and self.writer.written_at is not None:
                p.progress_at = max(p.progress_at or 0.0, self.writer.written_at)
            p.tokens_per_s = self.session_tokens / max(time.time() - self.t_start, 1e-6)
            p.samples_per_s = p.tokens_per_s * (p.samples_total / max(p.tokens_total, 1))
            remaining = p.tokens_total - p.tokens_done
            p.eta_s = remaining / p.tokens_per_s if p.tokens_per_s > 0 else None
            try:
                p.staged_bytes = scan_staging(self.staging).bytes
            except FileNotFoundError:
                p.staged_bytes = 0
            if last:
                p.save_last(self.run_dir)
            else:
                p.save(self.run_dir)
            self._saved_at = time.time()

    # -- the thread -------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._halt.wait(TICK_S):
            try:
                self._tick()
            except BaseException as e:  # kept for the main thread; the pipeline stops at its next batch
                self.failure = e
                self.stop.set()
                return

    def _tick(self) -> None:
        """Hear from the uploader, look for a stall, refresh the progress file if it is due."""
        self.uploader.check_alive()
        self.count_done(self.uploader.poll_done())
        self.progress.uploader_heartbeat_at = self.uploader.heartbeat_at
        now = time.time()
        if now - self._saved_at >= REFRESH_S:
            self._check_stall(now)
            self.save()

    def _check_stall(self, now: float) -> None:
        """Name the stalled process, if any (``stalls.worker_stall``), in the log and the progress file; log a
        stall that ended as recovered."""
        with self._lock:
            self._judge_stall(now)

    def _judge_stall(self, now: float) -> None:
        up, p = self.uploader, self.progress
        writer_at = self.writer.written_at if self.writer is not None else None
        stall, since = worker_stall(
            now=now,
            timeout=p.stall_timeout_s,
            state=p.state,
            batches_left=len(self.by_key) - len(self.done),
            last_progress_at=max(p.progress_at or 0.0, writer_at or 0.0, self.idle_from),
            uploads_waiting=len(self.writer.submitted - self.done) if self.writer is not None else 0,
            uploader_pid=up.pid if up is not None else None,
            uploader_heartbeat_at=up.heartbeat_at if up is not None else None,
            worker_pid=os.getpid(),
        )
        if same_stall(stall, self._stall):
            return
        if self._stall is not None:
            old = self._stall
            log.info(
                "shard %d: %s pid %d recovered after %.0f s", p.shard, old.process, old.pid, now - old.since
            )
        if stall is not None:
            note = stall_note(stall.pid) if stall.pid != os.getpid() else ""
            log.warning(
                "shard %d: %s pid %d stalled: %s for %.0f s (stall timeout %g s)%s",
                *(p.shard, stall.process, stall.pid, stall.reason, now - since, p.stall_timeout_s, note),
            )
        self._stall = stall
        p.stalled_process, p.stalled_pid, p.stall_reason = (
            (stall.process, stall.pid, stall.reason) if stall else ("", 0, "")
        )
        p.stalled_since = since if stall else None
