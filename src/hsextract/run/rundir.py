"""The run directory: every path in it (``RunDir``), what staging holds.

A run dir is what a rerun resumes from: the resolved config, the plan, the tokens, progress files, logs and locks.
Nothing in it says a batch is done: the output's completion records do (output/records.py), so a run dir lost,
copied or left behind by a crash never makes a batch count as done. ``COMPLETE``, written after the manifest, is
read by ``status`` only.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hsextract.errors import HsextractError, free_bytes
from hsextract.output.ledger import shard_name
from hsextract.startup.files import StartupFiles
from hsextract.storage.fileio import hold_lock

RUN_DIR_MIN_FREE_BYTES = 16 << 20

"""The least free space a run starts with in its run dir: its files are small (progress, logs, the token cache),
but a full run dir stops every worker with nothing recorded of why."""


def default_run_dir(output: str, node_rank: int | None = None) -> Path:
    """The run dir of a run given none: ``runs/<output's name>-<hash of the output>`` under the current directory,
    with ``-node<R>`` for node R of a job of several nodes (whose current directory may be shared).

    The same command rerun from the same directory finds the same run dir, so it resumes; two outputs never share
    one. The hash covers the output in full (a local path made absolute); the name is only for people.
    """
    remote = "://" in output
    full = output.rstrip("/") if remote else str(Path(output).expanduser().resolve())
    tail = output.split("://", 1)[1] if remote else Path(full).name
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", tail).strip("-.")[-60:] or "output"
    node = "" if node_rank is None else f"-node{node_rank}"
    return Path.cwd() / "runs" / f"{name}-{hashlib.sha256(full.encode()).hexdigest()[:8]}{node}"


@dataclass(frozen=True)
class RunDir:
    """Every path in a run directory; start-up names its own (startup/files.py). Nothing else spells them."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]):
        object.__setattr__(self, "root", Path(root))

    def __fspath__(self) -> str:
        return str(self.root)

    @property
    def config_file(self) -> Path:
        return self.root / "config.json"

    @property
    def info_file(self) -> Path:
        return self.root / "run.json"

    @property
    def plan_file(self) -> Path:
        return self.root / "plan.json"

    @property
    def data_report_file(self) -> Path:
        return self.root / "data_report.json"

    @property
    def tokens_file(self) -> Path:
        return self.root / "tokens.safetensors"

    @property
    def complete_file(self) -> Path:
        return self.root / "COMPLETE"

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def progress_dir(self) -> Path:
        return self.root / "progress"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def locks_dir(self) -> Path:
        return self.root / "locks"

    @property
    def startup(self) -> StartupFiles:
        """Start-up's files (the kernel cache's pointer, the warm-up's, the early workers' go files)."""
        return StartupFiles(self.root, shard_name, self.log_file)

    def progress_file(self, shard: int) -> Path:
        return self.progress_dir / f"{shard_name(shard)}.json"

    def reserve_file(self, shard: int) -> Path:
        return self.progress_dir / f"{shard_name(shard)}.reserve"

    def lock_file(self, shard: int) -> Path:
        return self.locks_dir / f"{shard_name(shard)}.lock"

    def log_file(self, shard: int, role: str = "") -> Path:
        """``role`` is "" for the worker, or ``uploader``, ``stderr``, ``warmup``."""
        suffix = f".{role}" if role else ""
        return self.logs_dir / f"{shard_name(shard)}{suffix}.log"

    def run_lock_file(self, shard: int) -> Path:
        return self.locks_dir / f"{shard_name(shard)}.run.lock"

    def lock_shard(self, shard: int):
        """An exclusive lock on ``shard`` for the life of the process (the open file holding it): two processes
        running one shard would race on its staging directory and output keys. The kernel drops the lock when the
        process dies."""
        f = hold_lock(self.lock_file(shard))
        if isinstance(f, str):
            raise HsextractError(
                f"shard {shard} of {self.root} is already being run by {f}; "
                "wait for it (hsextract status) or stop it before rerunning"
            )
        return f

    @contextmanager
    def owning_shards(self, shards, output: str):
        """The shards one ``hsextract run`` runs, owned by it (held, as the launcher lock is, for its life): their
        staging directories and progress are its own, and nothing it does on its way out touches another's. Taken
        before anything is prepared, so that a second run of the same shards is refused at once, touching nothing
        of the first's."""
        held = []
        try:
            for shard in shards:
                f = hold_lock(self.run_lock_file(shard))
                if isinstance(f, str):
                    raise HsextractError(
                        f"output {output} is being written by another hsextract run ({f}, run dir {self.root}, "
                        f"shard {shard}): a second run would race it on the same batches. Wait for it to finish "
                        f"(hsextract status {self.root}) or stop it first"
                    )
                held.append(f)
            yield
        finally:
            for f in held:
                f.close()

    @contextmanager
    def preparing(self, echo=print):
        """Held while a run prepares (tokens, plan, run files): runs of other shards of this run dir write the same
        files, so they prepare one after the other, the second waiting for the first."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        with open(self.locks_dir / "prepare.lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                echo(f"waiting for another run on run dir {self.root} to finish preparing")
                fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def shards_in_use(self, shards) -> str:
        """Who runs one of ``shards`` of this run dir ("pid N on H"), or "" if no run holds them. Only looks: the
        run dir may be another run's."""
        for shard in shards:
            try:
                f = open(self.run_lock_file(shard))
            except OSError:  # no run ever owned it here
                continue
            with f:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return f.read().strip() or "another process"
        return ""

    def check_space(self) -> None:
        """Refuse to start on a run dir file system with less than ``RUN_DIR_MIN_FREE_BYTES`` free."""
        free = free_bytes(self.root)
        if free is not None and free < RUN_DIR_MIN_FREE_BYTES:
            raise HsextractError(
                f"run dir {self.root} has {free:,} bytes free on its file system, under the "
                f"{RUN_DIR_MIN_FREE_BYTES:,} a run needs there (progress, logs, the token cache): free "
                "space there or choose another --run-dir"
            )

    def low_space_note(self) -> str:
        """Why a worker that failed may have recorded nothing: its run dir's file system is (nearly) full; "" if
        it is not."""
        free = free_bytes(self.root)
        if free is None or free >= RUN_DIR_MIN_FREE_BYTES:
            return ""
        return (
            f"no error recorded, and run dir {self.root} has {free:,} bytes free on its file system: a worker "
            "that cannot write there cannot record why it stopped (No space left on device?). Free space there, "
            "then rerun the same command to resume"
        )

    def is_run_dir(self) -> bool:
        return self.plan_file.exists()

    def check_is_dir(self) -> None:
        """Refuse a run dir path that names a file (before anything is written under it)."""
        if self.root.exists() and not self.root.is_dir():
            raise HsextractError(f"--run-dir {self.root} is a file, not a directory: choose a directory path")

    @contextmanager
    def launcher_lock(self, *, exclusive: bool):
        """Held by every ``hsextract run`` on this run dir for its whole life: shared by plain runs (each owns its
        shards, ``owning_shards``), exclusive for ``--restart``, which must not clear progress and staging under a
        run that is still going. A run dir this call made goes again if the run stops before anything but the lock
        was written in it and no other run holds it (a run refused by its checks leaves no empty run dir)."""
        self.check_is_dir()
        made = None  # the highest directory this call makes (the run dir, or runs/ above it)
        for path in (self.root.absolute(), *self.root.absolute().parents):
            if path.exists():
                break
            made = path
        with self._locked(exclusive=exclusive) as f:
            try:
                yield
            except BaseException:
                # Two runs started together both see no run dir: only one left alone on it may remove it.
                if made is not None and _alone(f) and self._holds_only_the_lock(made):
                    shutil.rmtree(made, ignore_errors=True)
                raise

    def _holds_only_the_lock(self, top: Path) -> bool:
        """Nothing but the locks and the data files' hash memos (redone in milliseconds) was written under ``top``."""
        locks, memos = self.locks_dir.absolute(), self.cache_dir.absolute()
        return all(
            p == locks / "launcher.lock"
            or (p.parent == locks and (p.name.endswith(".run.lock") or p.name == "prepare.lock"))
            or (p.parent == memos and p.name.startswith("data-") and p.suffix == ".json")
            for p in top.rglob("*")
            if not p.is_dir()
        )

    @contextmanager
    def _locked(self, *, exclusive: bool):
        if self.locks_dir.exists() and not self.locks_dir.is_dir():
            raise HsextractError(
                f"{self.locks_dir} is a file where the run dir keeps its locks (a directory): remove it, "
                "or choose another --run-dir"
            )
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        with open(self.locks_dir / "launcher.lock", "a+") as f:
            try:
                fcntl.flock(f, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                raise HsextractError(
                    f"run dir {self.root} is in use by another hsextract run"
                    + (
                        ": --restart would clear its progress under it"
                        if exclusive
                        else " started with --restart"
                    )
                    + "; wait for it to finish (hsextract status) or stop it first"
                ) from None
            yield f


def _alone(f) -> bool:
    """Whether the lock held through ``f`` can be made exclusive now: no other process holds it."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@dataclass(frozen=True)
class StagedFiles:
    """What a shard's staging directory holds: the complete batch files waiting for the uploader."""

    count: int = 0
    bytes: int = 0
    oldest_mtime: float | None = None


def scan_staging(staging: Path) -> StagedFiles:
    """The batch files in ``staging`` (temporary files of the writer left out); raises ``OSError`` if it cannot be
    listed. Files the uploader removes during the scan are skipped."""
    count, size, oldest = 0, 0, None
    for entry in os.scandir(staging):
        if entry.name.endswith(".safetensors"):
            try:
                st = entry.stat()
            except FileNotFoundError:  # uploaded and removed meanwhile
                continue
            count, size = count + 1, size + st.st_size
            oldest = st.st_mtime if oldest is None else min(oldest, st.st_mtime)
    return StagedFiles(count, size, oldest)
