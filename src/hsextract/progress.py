"""Progress markers and per-shard progress files: what resume trusts and what ``hsextract status`` shows.

- Markers (``RunDir.marker``): written by the uploader after the batch is durable in the output (renamed into
  place locally, or confirmed in the bucket). The only thing resume trusts: a batch with a marker is never
  recomputed, a batch without one is (or is re-uploaded from staging).
- Progress files (``RunDir.progress_file``): counters, rates, ETA and state of each shard, replaced atomically by
  its worker. Informational; ``status`` recomputes the done counts from the markers.

``shard_status`` combines the two for ``hsextract status``; it lives here, not in the launcher, so that status
imports neither torch nor transformers and answers in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import HsextractError
from .plan import Plan
from .rundir import RunDir, atomic_write


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

    def save(self, run_dir: RunDir | Path) -> None:
        self.updated_at = time.time()
        # Rewritten every second and only ever reported: no fsync, but a reader still sees a whole file.
        atomic_write(RunDir(run_dir).progress_file(self.shard), json.dumps(asdict(self)), durable=False)

    @classmethod
    def load(cls, run_dir: RunDir | Path, shard: int) -> ShardProgress | None:
        try:
            return cls(**json.loads(RunDir(run_dir).progress_file(shard).read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host. A zombie does not: a worker killed with its launcher stays one
    until init reaps it, which some container inits do late or never."""
    if pid <= 0:
        return False
    if sys.platform.startswith("linux"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] not in "ZXx"  # the state field follows the parenthesized name
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shard_status(run_dir: RunDir | Path) -> tuple[list[dict], bool]:
    """Per-shard rows for ``hsextract status``: done counts from the markers, rates and state from progress.

    A shard whose progress says it is live but whose worker process is gone is ``crashed``. That is only known for
    workers on this host; a shard on another host (``--only-shards`` there, a shared run dir) keeps its state.
    """
    run_dir = RunDir(run_dir)
    if not run_dir.is_run_dir():
        raise HsextractError(
            f"{run_dir.root} is not an hsextract run directory (no {run_dir.plan_file.name})"
        )
    plan = Plan.load(run_dir.plan_file)
    done = run_dir.done_keys()
    complete = run_dir.complete_file.exists()
    host = socket.gethostname()
    rows = []
    for s in _local_shards(run_dir, plan):
        batches = plan.for_shard(s)
        n_done = sum(b.key in done for b in batches)
        tokens_done = sum(b.num_tokens for b in batches if b.key in done)
        tokens_total = sum(b.num_tokens for b in batches)
        p = ShardProgress.load(run_dir, s)
        state = p.state if p else "not started"
        if n_done == len(batches):
            state = "done"
        elif p and state not in ("done", "failed") and p.host == host and not pid_alive(p.pid):
            state = "crashed"
        rows.append(
            {
                "shard": s,
                "state": state,
                "batches_done": n_done,
                "batches_total": len(batches),
                "tokens_done": tokens_done,
                "tokens_total": tokens_total,
                "tokens_per_s": p.tokens_per_s if p and state not in ("done", "crashed", "failed") else 0.0,
                "eta_s": p.eta_s if p and state == "running" else None,
                "updated_at": p.updated_at if p else None,
                "host": p.host if p else "",
                "error": p.error if p else "",
                "log": str(run_dir.log_file(s)),
            }
        )
    return rows, complete


def _local_shards(run_dir: RunDir, plan: Plan) -> list[int]:
    """The shards this run dir's node runs (all of them on a single node)."""
    try:
        cfg = json.loads(run_dir.config_file.read_text())
        nodes, rank = int(cfg.get("nodes", 1)), int(cfg.get("node_rank", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return list(range(plan.shards))
    per_node = plan.shards // max(nodes, 1)
    return list(range(rank * per_node, (rank + 1) * per_node)) or list(range(plan.shards))


def format_duration(seconds: float) -> str:
    """``1h02m`` or ``3m05s``: ETAs in the status table and the dry run."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
