"""Start-up's files in a run dir (docs/FORMAT.md lists them): the run dir (run/rundir.py) hands over its directory,
how it names a shard and its log files, so that a shard and a log are spelled one way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StartupFiles:
    root: Path
    """The run dir."""
    shard_name: Callable[[int], str]
    log_file: Callable[[int, str], Path]
    """A shard's log file for a role ("stderr", "warmup")."""

    @property
    def kernel_cache_pointer(self) -> Path:
        """Names the kernel cache the run used (warmup/cache.py)."""
        return self.root / "kernel-cache.json"

    @property
    def warmup_spec_file(self) -> Path:
        """What the kernel warm-up compiles for."""
        return self.root / "warmup.json"

    @property
    def warmup_done_file(self) -> Path:
        """Written when the warm-up process ends, however it ends: the workers wait for it."""
        return self.root / "warmup.done"

    @property
    def warmup_log(self) -> Path:
        return self.log_file(0, "warmup")

    def go_file(self, shard: int) -> Path:
        """The go (or stop) of a worker started before the plan was ready (early.py)."""
        return self.root / "prestart" / f"{self.shard_name(shard)}.json"
