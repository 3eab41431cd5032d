"""Per-shard progress files: each worker's counters, rates, ETA and state, what ``hsextract status`` shows.

Replaced atomically by the worker's monitor at least every second, so ``updated_at`` is the worker's heartbeat.
The done counts are a tally, shown and never trusted (resume and finalize read the output). A file that does not
hold what a worker writes is reported as damaged, never a traceback.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hsextract.config import DEFAULT_STALL_TIMEOUT_S
from hsextract.run.rundir import RunDir
from hsextract.storage.fileio import atomic_write
from hsextract.validation import parse


class ShardState(str, enum.Enum):
    """A shard's state: what its worker writes in its progress file (the first eight), and what ``status``
    concludes from the output's records and the processes (``crashed``, ``stalled``, ``damaged``, ``not started``)."""

    STARTING = "starting"
    LOADING = "loading"
    WAITING_FOR_KERNELS = "waiting-for-kernels"
    RUNNING = "running"
    WAITING_FOR_UPLOADER = "waiting-for-uploader"
    DRAINING = "draining"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"
    CRASHED = "crashed"
    STALLED = "stalled"
    DAMAGED = "damaged"
    NOT_STARTED = "not started"

    __str__ = str.__str__
    __format__ = str.__format__


LIVE_STATES = tuple(
    ShardState(s)
    for s in ("starting", "loading", "waiting-for-kernels", "running", "waiting-for-uploader", "draining")
)
"""A worker process is at work."""
FINAL_STATES = (ShardState.DONE, ShardState.FAILED, ShardState.STOPPED)
"""The worker has ended and said how."""
WORKER_STATES = frozenset(str(s) for s in (*LIVE_STATES, *FINAL_STATES))
"""The states a worker writes in its progress file."""

MAX_FIGURE = 1e12

"""Above any rate, duration or size a worker writes (tokens/s, seconds, staged bytes): a larger one is damage."""


class DamagedProgress(ValueError):
    """A progress file that does not hold a shard's progress; the message names the file and the problem."""


RESERVE_BYTES = 64 << 10

"""Room each worker keeps in the run dir while it runs: a progress file is at most 16 kB."""


HISTORY_POINTS = 400

"""Bound on a shard's rate history. When it is full every other point goes and the spacing doubles: a short run
keeps a point every few seconds, a week-long one a point every half hour, and the file stays under 16 kB."""


@dataclass
class ShardProgress:
    shard: int
    state: str = "starting"
    """starting | loading | waiting-for-kernels | running | waiting-for-uploader | draining | done | failed |
    stopped (by a signal)"""
    pid: int = 0
    host: str = ""
    batches_total: int = 0
    batches_done: int = 0
    samples_total: int = 0
    samples_done: int = 0
    tokens_total: int = 0
    tokens_done: int = 0
    tokens_per_s: float = 0.0
    """The shard's rate, the one figure the bar, ``status``, its page and ``/metrics`` show: tokens made durable in
    the output this session per second since its forwards began (the model's load excluded). ``eta_s`` is the tokens
    left at that rate."""
    samples_per_s: float = 0.0
    eta_s: float | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    staged_bytes: int = 0
    error: str = ""
    progress_at: float | None = None
    """When this session's tokens last advanced (a batch written or uploaded); None before the first."""
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    """The run's stall timeout, so that ``status`` judges this file without the run's config."""
    uploader_pid: int = 0
    uploader_heartbeat_at: float | None = None
    """When the worker last heard from its uploader process (None: no uploader running)."""
    stalled_process: str = ""
    """``uploader`` or ``worker`` while the worker sees a stall itself, else empty."""
    stalled_pid: int = 0
    stalled_since: float | None = None
    stall_reason: str = ""
    """What is stalled, in words: ``no heartbeat for 12 s``, ``no batch uploaded for 200 s``."""
    history: list = field(default_factory=list)
    """``[time, tokens_done, staged_bytes]`` points, oldest first, ``history_step_s`` apart but for the last, which
    is the latest save; the status page charts rates from it. A resumed shard carries it on."""
    history_step_s: float = 2.0
    # How validation.parse reads a progress file: unknown keys and non-finite numbers are damage.
    __pydantic_config__ = {"extra": "forbid", "allow_inf_nan": False}

    def save(self, run_dir: RunDir | Path) -> None:
        self.updated_at = time.time()
        self._record_history(self.updated_at)
        # Rewritten every second and only ever reported: no fsync, but a reader still sees a whole file.
        atomic_write(RunDir(run_dir).progress_file(self.shard), json.dumps(asdict(self)), durable=False)

    def keep_room(self, run_dir: RunDir | Path) -> None:
        """Set ``RESERVE_BYTES`` aside in the run dir for ``save_last`` (written, so that the blocks are taken)."""
        atomic_write(RunDir(run_dir).reserve_file(self.shard), bytes(RESERVE_BYTES), durable=False)

    def save_last(self, run_dir: RunDir | Path) -> bool:
        """The worker's last save (done, failed, stopped): on a full file system the room ``keep_room`` kept is
        given up first, so that the file still says how the shard ended. Returns whether it was saved."""
        reserve = RunDir(run_dir).reserve_file(self.shard)
        try:
            try:
                self.save(run_dir)
            except OSError:
                reserve.unlink(missing_ok=True)
                self.save(run_dir)
        except OSError:
            return False
        finally:
            reserve.unlink(missing_ok=True)
        return True

    def _record_history(self, now: float) -> None:
        point = [round(now, 3), self.tokens_done, self.staged_bytes]
        if len(self.history) >= 2 and self.history[-1][0] - self.history[-2][0] < self.history_step_s:
            self.history[-1] = point  # the latest point moves on until it is a step past the one before
            return
        self.history.append(point)
        if len(self.history) > HISTORY_POINTS:  # HISTORY_POINTS + 1 points, an odd count: first and last stay
            self.history = self.history[::2]
            self.history_step_s *= 2

    @classmethod
    def load(cls, run_dir: RunDir | Path, shard: int) -> ShardProgress | None:
        """The shard's progress; None if there is no progress file or it is damaged (``read`` tells which)."""
        try:
            return cls.read(run_dir, shard)
        except DamagedProgress:
            return None

    @classmethod
    def read(cls, run_dir: RunDir | Path, shard: int) -> ShardProgress | None:
        """The shard's progress, None if it has no progress file; ``DamagedProgress`` if the file holds anything
        but a progress record of this shard (keys this version does not know included)."""
        path = RunDir(run_dir).progress_file(shard)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DamagedProgress(f"{path}: cannot be read ({e.strerror or e})") from None
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise DamagedProgress(f"{path}: not JSON ({len(raw)} bytes)") from None
        if not isinstance(record, dict):
            raise DamagedProgress(f"{path}: holds {_json_kind(record)}, not a progress record") from None
        progress = parse(cls, raw, lambda problems: DamagedProgress(f"{path}: {problems}"))
        if progress.shard != shard:
            raise DamagedProgress(f"{path}: shard is {progress.shard!r}, expected {shard}")
        if problem := progress._problem():
            raise DamagedProgress(f"{path}: {problem}")
        return progress

    def _problem(self) -> str | None:
        """What no worker writes, though each field has its type: an unknown state, a negative count, a rate no GPU
        reaches, a clock that runs back. Shown as damage, never as a figure."""
        if self.state not in WORKER_STATES:
            return f"state {self.state!r} is not one a worker writes"
        for name in ("batches", "samples", "tokens"):
            for count in (f"{name}_done", f"{name}_total"):
                if not 0 <= getattr(self, count) <= MAX_FIGURE:
                    return f"{count} {getattr(self, count)} is not a count a worker writes"
        for name in ("tokens_per_s", "samples_per_s", "eta_s", "staged_bytes", "stall_timeout_s"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_FIGURE:
                return f"{name} {value} is not a figure a worker writes (0 to {MAX_FIGURE:.0e})"
        if not 0 < self.started_at <= self.updated_at:
            return f"updated_at {self.updated_at} is before started_at {self.started_at}"
        for point in self.history:
            if not (
                isinstance(point, list)
                and len(point) == 3
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in point)
                and 0 <= point[1] <= MAX_FIGURE
                and 0 < point[0] <= self.updated_at + 1.0
            ):
                return f"history point {str(point)[:60]} is not [time, tokens, bytes] up to updated_at"
        return None

    @property
    def last_progress_at(self) -> float:
        """When the shard last advanced, or its worker started if it has not yet."""
        return self.progress_at if self.progress_at is not None else self.started_at


def _json_kind(value) -> str:
    if value is None:
        return "null"
    return {list: "a list", str: "a string", bool: "a boolean", dict: "an object"}.get(
        type(value), "a number"
    )


def format_bytes(n: float) -> str:
    """``812 B``, ``4.1 MB``, ``2.90 GB``, ``15.7 TB``: a size in the unit that fits (a tiny job is not ``0.00 GB``)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:,.2f} {unit}" if value < 10 else f"{value:,.1f} {unit}"
    return f"{int(n)} B"


def rate_text(p: ShardProgress) -> str:
    """``running, 1,666 tok/s, eta 0m12s``: a shard's state, rate and (while it runs) ETA, as the bar shows them."""
    eta = f", eta {format_duration(p.eta_s)}" if p.state == ShardState.RUNNING and p.eta_s is not None else ""
    return f"{p.state}, {p.tokens_per_s:,.0f} tok/s{eta}"


def format_duration(seconds: float) -> str:
    """``1h02m`` or ``3m05s``: ETAs in the status table and the dry run."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
