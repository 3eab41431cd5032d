"""The rows of ``hsextract status``, computed in one place: per shard of a run dir (done counts from the output's
completion records, rates and state from the progress files, process liveness and stalls from this host) and per
shard of an output (from its completion records alone: every node's shards, with no run dir). No torch: status
answers in a fraction of a second on a local output.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

from hsextract.config import RunConfig, node_shards
from hsextract.errors import HsextractError
from hsextract.output import Plan
from hsextract.output.ledger import JOB_FILES, done_in_output, has_manifest, load_plan, read_job
from hsextract.run.procs import pid_alive
from hsextract.run.progress import FINAL_STATES, DamagedProgress, ShardProgress, ShardState
from hsextract.run.rundir import RunDir
from hsextract.run.stalls import find_stall, stall_note
from hsextract.storage import open_sink

OUTPUT_LIST_DEADLINE_S = 5.0

"""How long ``status RUN_DIR`` retries listing the output's completion records before it shows the workers' own
counts instead."""


def _counts(batches: list, done: set[str] | None, p: ShardProgress | None = None) -> dict:
    """``done``: the keys the output records done; None to take the counts the shard's worker last saved in ``p``."""
    if done is None:
        return {
            "batches_done": p.batches_done if p else 0,
            "batches_total": len(batches),
            "tokens_done": p.tokens_done if p else 0,
            "tokens_total": sum(b.num_tokens for b in batches),
        }
    return {
        "batches_done": sum(b.key in done for b in batches),
        "batches_total": len(batches),
        "tokens_done": sum(b.num_tokens for b in batches if b.key in done),
        "tokens_total": sum(b.num_tokens for b in batches),
    }


def shard_status(run_dir: RunDir | Path, plan: Plan | None = None) -> tuple[list[dict], bool]:
    """Per-shard rows for ``hsextract status``: done counts from the output's completion records (from the progress
    files where the output cannot be listed from here), rates and state from progress.

    A shard whose progress says it is live but whose worker process is gone is ``crashed``; one whose worker or
    uploader has stalled (``find_stall``) is ``stalled``. Process liveness is only known for workers on this host;
    a shard on another host (``--only-shards`` there, a shared run dir) keeps its state. A damaged progress file
    is reported in ``damaged`` (and as the state, unless the output shows the shard done).
    ``plan`` spares reading plan.json again (the status server keeps it between requests).
    """
    run_dir = RunDir(run_dir)
    if not run_dir.is_run_dir():
        raise HsextractError(
            f"{run_dir.root} is not an hsextract run directory (no {run_dir.plan_file.name})"
        )
    plan = plan or Plan.load(run_dir.plan_file)
    done = _done_in_output(run_dir)
    complete = run_dir.complete_file.exists()
    host = socket.gethostname()
    now = time.time()
    rows = []
    by_shard = _by_shard(plan)
    for s in _local_shards(run_dir, plan):
        try:
            p, damaged = ShardProgress.read(run_dir, s), ""
        except DamagedProgress as e:
            p, damaged = None, str(e)
        counts = _counts(by_shard[s], done, p)
        state = ShardState(p.state) if p else (ShardState.DAMAGED if damaged else ShardState.NOT_STARTED)
        stall = None
        if counts["batches_done"] == counts["batches_total"]:
            state = ShardState.DONE
        elif p and state not in FINAL_STATES:
            local = p.host == host
            if local and not pid_alive(p.pid):
                state = ShardState.CRASHED
            elif stall := find_stall(p, now):
                state = ShardState.STALLED
                if local:
                    stall = dataclasses.replace(stall, reason=stall.reason + stall_note(stall.pid))
        live = p is not None and state not in (*FINAL_STATES, ShardState.CRASHED)
        rows.append(
            {
                "shard": s,
                "state": state,
                **counts,
                "tokens_per_s": p.tokens_per_s if live else 0.0,
                **_session(p),
                "eta_s": p.eta_s if p and state == ShardState.RUNNING else None,
                "updated_at": p.updated_at if p else None,
                "last_progress_at": p.last_progress_at if p else None,
                "progress_age_s": round(now - p.last_progress_at, 1) if p else None,
                "pid": p.pid if p else 0,
                "uploader_pid": p.uploader_pid if p else 0,
                "stalled_process": stall.process if stall else "",
                "stalled_pid": stall.pid if stall else 0,
                "stalled_for_s": round(now - stall.since, 1) if stall else None,
                "stall_reason": stall.reason if stall else "",
                "host": p.host if p else "",
                "error": (p.error if p else "")
                or (run_dir.low_space_note() if state in (ShardState.CRASHED, ShardState.FAILED) else ""),
                "damaged": damaged,
                "log": str(run_dir.log_file(s)),
            }
        )
    return rows, complete


def _done_in_output(run_dir: RunDir) -> set[str] | None:
    """The batch keys the run's output records done (one listing); None where it cannot be listed from here (no
    credentials on this host, an endpoint down): status still answers, from what the workers last saved."""
    try:
        cfg = RunConfig.load(run_dir.config_file)
        return done_in_output(
            open_sink(cfg.output, cfg.s3_endpoint_url, retry_deadline_s=OUTPUT_LIST_DEADLINE_S)
        )
    except Exception:  # whatever the output answers, status shows the run
        return None


def _session(p: ShardProgress | None) -> dict:
    """The last session's length (from its start to its last save) and its rate as the worker last saved it (the
    one rate the bar showed: ``ShardProgress.tokens_per_s``): what a finished shard shows instead of a live rate."""
    if p is None:
        return {"elapsed_s": None, "average_tokens_per_s": None}
    elapsed = max(p.updated_at - p.started_at, 0.0)
    return {"elapsed_s": round(elapsed, 1), "average_tokens_per_s": p.tokens_per_s if elapsed > 0 else None}


def _by_shard(plan: Plan) -> dict[int, list]:
    """Each shard's batches, in one pass over the plan (a pass per shard is shards x batches)."""
    by_shard: dict[int, list] = {s: [] for s in range(plan.shards)}
    for b in plan.batches:
        by_shard.setdefault(b.shard, []).append(b)
    return by_shard


def _local_shards(run_dir: RunDir, plan: Plan) -> list[int]:
    """The shards this run dir's node runs (all of them on a single node)."""
    try:
        cfg = json.loads(run_dir.config_file.read_text())
        nodes, rank = int(cfg.get("nodes", 1)), int(cfg.get("node_rank", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return list(range(plan.shards))
    return node_shards(plan.shards, nodes, rank) or list(range(plan.shards))


def output_status(sink) -> dict:
    """Per-shard and per-node progress of a job from its output alone (``hsextract status OUTPUT``)."""
    if (missing := sink.missing_place()) is not None:
        raise HsextractError(missing)
    job = read_job(sink)
    if job is None:
        raise HsextractError(f"{sink.url} holds no hsextract job (no {JOB_FILES['plan']} or claim)")
    plan, _info = load_plan(sink)
    done = done_in_output(sink)
    nodes = max(1, int(job.get("nodes", 1)))
    by_shard = _by_shard(plan)
    rows = []
    for node in range(nodes):
        for s in node_shards(plan.shards, nodes, node):
            counts = _counts(by_shard[s], done)
            done_all = counts["batches_done"] == counts["batches_total"]
            state = ShardState.DONE if done_all else "in progress or not started"
            rows.append({"shard": s, "node": node, "state": state, **counts})
    return {
        "output": sink.url,
        "plan_hash": job.get(
            "plan_hash"
        ),  # the claim's: the plan's own is a hash of all of it, seconds at 1M samples
        "nodes": nodes,
        "complete": has_manifest(sink),
        "checked_at": time.time(),
        "shards": rows,
    }
