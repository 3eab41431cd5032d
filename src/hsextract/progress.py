"""Progress markers and per-shard progress files: what resume trusts and what ``hsextract status`` shows.

Layout under the run directory:

- ``markers/shard-SSSSS/batch-BBBBBB.safetensors.done``: written by the uploader after the batch is durable in the
  output (renamed into place locally, or confirmed in the bucket). The only thing resume trusts: a batch with a
  marker is never recomputed, a batch without one is (or is re-uploaded from staging).
- ``progress/shard-SSSSS.json``: counters, rates, ETA and state of each shard, replaced atomically by its worker.
  Informational; ``status`` recomputes the done counts from the markers.
- ``logs/shard-SSSSS.log``: each worker's log (the uploader's is ``shard-SSSSS.uploader.log``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MARKER_SUFFIX = ".done"


def markers_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "markers"


def done_keys(run_dir: Path) -> set[str]:
    """Output keys of every batch recorded durable, listed once."""
    root = markers_dir(run_dir)
    if not root.exists():
        return set()
    keys = set()
    for shard_dir in root.iterdir():
        if shard_dir.is_dir():
            for entry in os.scandir(shard_dir):
                if entry.name.endswith(MARKER_SUFFIX):
                    keys.add(f"{shard_dir.name}/{entry.name[: -len(MARKER_SUFFIX)]}")
    return keys


def progress_path(run_dir: Path, shard: int) -> Path:
    return Path(run_dir) / "progress" / f"shard-{shard:05d}.json"


def log_path(run_dir: Path, shard: int, role: str = "") -> Path:
    suffix = f".{role}" if role else ""
    return Path(run_dir) / "logs" / f"shard-{shard:05d}{suffix}.log"


@dataclass
class ShardProgress:
    shard: int
    state: str = "starting"
    """starting | loading | running | waiting-for-uploader | draining | done | failed"""
    pid: int = 0
    host: str = ""
    batches_total: int = 0
    batches_done: int = 0
    samples_total: int = 0
    samples_done: int = 0
    tokens_total: int = 0
    tokens_done: int = 0
    tokens_per_s: float = 0.0
    samples_per_s: float = 0.0
    eta_s: float | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    staged_bytes: int = 0
    error: str = ""

    def save(self, run_dir: Path) -> None:
        self.updated_at = time.time()
        path = progress_path(run_dir, self.shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def load(cls, run_dir: Path, shard: int) -> ShardProgress | None:
        try:
            return cls(**json.loads(progress_path(run_dir, shard).read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
