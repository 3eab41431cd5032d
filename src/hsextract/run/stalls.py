"""Stalls: a shard's worker or uploader that stops making progress without dying, named, never killed.

Three places watch, each from what it can see, and all judge with the code here: the worker's monitor
(``worker_stall``), the launcher (``StallWatch``, from the progress files) and ``status`` (``find_stall``, after
the fact or from another process). A stall that ends is reported as recovered, once.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

from hsextract.run.procs import proc_state
from hsextract.run.progress import LIVE_STATES, ShardProgress, ShardState
from hsextract.run.rundir import RunDir

STARTUP_GRACE_S = 120.0

"""A worker writes its first progress file after importing torch and reading the tokens; until then it counts as
stalled only after this long (or the stall timeout, if longer)."""


def stall_note(pid: int) -> str:
    """`` (the process is stopped, SIGSTOP?)`` for a process of this host stopped by a signal, else empty."""
    return " (the process is stopped: SIGSTOP?)" if proc_state(pid) in ("T", "t") else ""


@dataclass(frozen=True)
class Stall:
    """A stalled process of a shard: which, its pid, since when, and what was seen."""

    process: str
    """``worker`` or ``uploader``."""
    pid: int
    since: float
    reason: str


def find_stall(p: ShardProgress, now: float | None = None) -> Stall | None:
    """The stall a live shard's progress file shows: the worker itself when its file has not been refreshed for
    the stall timeout while it is alive (its monitor refreshes it every second), else what the worker
    reported (its uploader silent, or no batch finished for the timeout)."""
    now = time.time() if now is None else now
    if p.state not in LIVE_STATES:
        return None
    silent = now - p.updated_at
    if silent > p.stall_timeout_s:
        return Stall("worker", p.pid, p.updated_at, "progress file not refreshed")
    if p.stalled_process:
        since = p.stalled_since if p.stalled_since is not None else p.updated_at
        return Stall(p.stalled_process, p.stalled_pid, since, p.stall_reason)
    return None


def worker_stall(
    *,
    now: float,
    timeout: float,
    state: str,
    batches_left: int,
    last_progress_at: float,
    uploads_waiting: int,
    uploader_pid: int | None,
    uploader_heartbeat_at: float | None,
    worker_pid: int,
) -> tuple[Stall | None, float]:
    """What a worker sees of a stall: its uploader sending no heartbeat, or no batch finished since
    ``last_progress_at`` while batches are due (the uploader's fault when uploads wait for it)."""
    if (
        uploader_pid is not None
        and uploader_heartbeat_at is not None
        and now - uploader_heartbeat_at > timeout
    ):
        return Stall("uploader", uploader_pid, uploader_heartbeat_at, "no heartbeat"), uploader_heartbeat_at
    busy = (ShardState.RUNNING, ShardState.WAITING_FOR_UPLOADER, ShardState.DRAINING)
    if state in busy and batches_left and now - last_progress_at > timeout:
        if uploads_waiting and uploader_pid is not None:
            reason = f"no batch uploaded ({uploads_waiting} waiting)"
            return Stall("uploader", uploader_pid, last_progress_at, reason), last_progress_at
        return Stall("worker", worker_pid, last_progress_at, "no batch computed"), last_progress_at
    return None, now


def same_stall(a: Stall | None, b: Stall | None) -> bool:
    """One stall seen twice: the same process (its reason and start may be restated)."""
    return (a and (a.process, a.pid)) == (b and (b.process, b.pid))


class StallWatch:
    """Prints a line when a shard's worker or uploader stalls and one when it recovers, once per stall."""

    def __init__(self, run_dir: RunDir, timeout: float, echo):
        self.run_dir, self.timeout, self.echo = run_dir, timeout, echo
        self.started: dict[int, float] = {}
        """When each shard was first checked, about when its worker started."""
        self.current: dict[int, Stall] = {}
        """The stall printed last for each shard, until it recovers."""

    def check(self, shard: int, proc: subprocess.Popen, p: ShardProgress | None) -> None:
        """Compare the shard's stall (none, or which process) with the last one printed; print a change."""
        now = time.time()
        started = self.started.setdefault(shard, now)
        if p is None or p.pid != proc.pid:
            # This worker has not written its progress yet: it imports torch and reads the tokens first.
            late = now - started > max(self.timeout, STARTUP_GRACE_S)
            stall = Stall("worker", proc.pid, started, "no progress file yet") if late else None
        else:
            stall = find_stall(p, now)
        old = self.current.get(shard)
        if same_stall(stall, old):
            return
        if old is not None:
            self._recovered(shard, old, now)
        if stall is not None:
            log = self.run_dir.log_file(shard, "uploader" if stall.process == "uploader" else "")
            self.echo(
                f"shard {shard}: {stall.process} pid {stall.pid} stalled: {stall.reason} for "
                f"{now - stall.since:.0f} s{stall_note(stall.pid)}; log: {log}"
            )
            self.current[shard] = stall
        else:
            self.current.pop(shard, None)

    def finished(self, shard: int) -> None:
        """The shard's worker exited 0: a stall printed for it has ended, even if no check saw the heartbeat come
        back before the exit."""
        old = self.current.pop(shard, None)
        if old is not None:
            self._recovered(shard, old, time.time())

    def _recovered(self, shard: int, old: Stall, now: float) -> None:
        self.echo(f"shard {shard}: {old.process} pid {old.pid} recovered after {now - old.since:.0f} s")
