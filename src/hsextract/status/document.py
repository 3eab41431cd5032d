"""What ``hsextract status`` reports, as one document: ``status --json``, ``/api/status``, the page and ``/metrics``
all read ``status_document``, so they never disagree.

Built on each call from the run directory and one listing of the output's completion records, without torch.
``history`` (the shards' rate history for the charts) is kept out of the document so that ``--json`` stays short.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.output import Plan, StateLayout
from hsextract.output.ledger import RunInfo, shard_name
from hsextract.prepare.report import COUNTS
from hsextract.run.progress import LIVE_STATES, ShardProgress, ShardState
from hsextract.run.rundir import RunDir, scan_staging
from hsextract.status.rows import shard_status

ACTIVE_STATES = (*LIVE_STATES, ShardState.STALLED)

"""States in which a worker process is there: its staging directory and rate mean something."""


def status_document(run_dir: RunDir | Path, *, with_gpus: bool = True) -> dict:
    """The status of a run, live or finished: ``{"complete", "shards": [row...], "totals", "plan", "gpus"}``."""
    run_dir = RunDir(run_dir)
    rows, complete = shard_status(run_dir, _load_plan(run_dir))
    now = time.time()
    cfg = _load_config(run_dir)
    for row in rows:
        active = row["state"] in ACTIVE_STATES
        progress = ShardProgress.load(run_dir, row["shard"]) if active else None
        row["staged_bytes"] = progress.staged_bytes if progress else 0
        row.update(_uploads(cfg, row["shard"], now) if active else _NO_UPLOADS)
    gpus = gpu_status() if with_gpus else []
    _match_gpus(rows, gpus, cfg)
    return {
        "run_dir": str(run_dir.root),
        "generated_at": now,
        "complete": complete,
        "shards": rows,
        "totals": _totals(rows),
        "plan": plan_summary(run_dir, cfg),
        "gpus": gpus,
    }


def history(run_dir: RunDir | Path) -> dict[int, list[list[float]]]:
    """Each shard's ``[time, tokens_done, staged_bytes]`` points, oldest first, for the shards with a progress file
    in this run dir (this node's); empty for a damaged file."""
    run_dir = RunDir(run_dir)
    out = {}
    for s in range(_load_plan(run_dir).shards):
        if run_dir.progress_file(s).exists():
            progress = ShardProgress.load(run_dir, s)
            out[s] = [p for p in progress.history if isinstance(p, list) and len(p) >= 3] if progress else []
    return out


# -- rows -----------------------------------------------------------------------------------------------------------
_NO_UPLOADS = {"uploads_waiting": None, "upload_lag_s": None}


def _uploads(cfg: RunConfig | None, shard: int, now: float) -> dict:
    """Files waiting in the shard's staging directory and the age of the oldest, where staging is on this host."""
    if cfg is None:
        return dict(_NO_UPLOADS)
    try:
        staged = scan_staging(cfg.staging_dir / shard_name(shard))
    except OSError:
        return dict(_NO_UPLOADS)
    lag = 0.0 if staged.oldest_mtime is None else max(0.0, now - staged.oldest_mtime)
    return {"uploads_waiting": staged.count, "upload_lag_s": lag}


def _totals(rows: list[dict]) -> dict:
    live = [r for r in rows if r["state"] in ACTIVE_STATES]
    rate = sum(r["tokens_per_s"] for r in live)
    tokens_done = sum(r["tokens_done"] for r in rows)
    tokens_total = sum(r["tokens_total"] for r in rows)
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    return {
        "batches_done": sum(r["batches_done"] for r in rows),
        "batches_total": sum(r["batches_total"] for r in rows),
        "tokens_done": tokens_done,
        "tokens_total": tokens_total,
        "tokens_per_s": rate,
        "eta_s": (tokens_total - tokens_done) / rate if rate > 0 and live else None,
        "staged_bytes": sum(r["staged_bytes"] for r in rows),
        "states": states,
    }


# -- plan -----------------------------------------------------------------------------------------------------------
_plan_cache: dict[Path, tuple[tuple, Plan]] = {}


def _load_plan(run_dir: RunDir) -> Plan:
    """The plan, parsed again only when its file changed: a week-long run's plan is tens of MB."""
    path = run_dir.plan_file
    try:
        st = path.stat()
    except FileNotFoundError:
        raise HsextractError(f"{run_dir.root} is not an hsextract run directory (no {path.name})") from None
    stamp = (st.st_mtime_ns, st.st_size)
    cached = _plan_cache.get(path)
    if cached is None or cached[0] != stamp:
        _plan_cache[path] = cached = (stamp, Plan.load(path))
    return cached[1]


def _load_config(run_dir: RunDir) -> RunConfig | None:
    try:
        return RunConfig.load(run_dir.config_file)
    except (OSError, ValueError, TypeError, HsextractError):
        return None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def plan_summary(run_dir: RunDir, cfg: RunConfig | None = None) -> dict:
    """Model, layers and what each id means, sizes, and the data report's counts."""
    plan = _load_plan(run_dir)
    damaged = []  # a run-dir record that does not hold what preparation writes is named, never shown as figures
    try:
        meta = RunInfo.load(run_dir).to_json()
    except HsextractError as e:
        meta = {}
        if run_dir.info_file.exists():
            damaged.append(str(e).split(": nothing was changed")[0])
    report = _read_json(run_dir.data_report_file)
    if problem := _report_problem(report):
        damaged.append(f"{run_dir.data_report_file} is damaged ({problem})")
        report = {}
    layer_ids = meta.get("layer_ids") or plan.fingerprint.get("layer_ids") or []
    types = meta.get("layer_types") or [""] * len(layer_ids)
    return {
        "model": plan.fingerprint.get("model", cfg.model if cfg else ""),
        "output": cfg.output if cfg else "",
        "device": cfg.device if cfg else "",
        "dtype": plan.fingerprint.get("dtype", ""),
        "plan_hash": plan.plan_hash,
        "shards": plan.shards,
        "batches": len(plan.batches),
        "samples": plan.num_samples,
        "tokens": plan.num_tokens,
        "padding_waste": plan.padding_waste,
        "num_layers": meta.get("num_layers"),
        "hidden_size": meta.get("hidden_size"),
        "layer_convention": StateLayout.CONVENTION,
        "layers": [
            {
                "id": k,
                "type": t,
                "captures": f"output of decoder layer {k}",
                "hf_output_hidden_states_index": k + 1,
                "vllm_speculators_id": k + 1,
            }
            for k, t in zip(layer_ids, types, strict=False)
        ],
        "data_report": {
            key: report[key]
            for key in (*COUNTS, "duplicate_ids_renamed", "tokens", "max_length", "unrendered")
            if key in report
        },
        "data_sources": [
            {key: s[key] for key in ("name", "source", *COUNTS, "tokens", "unrendered") if key in s}
            for s in report.get("sources", [])
        ],
        "staging_max_bytes": int(cfg.staging_max_gb * 1e9) if cfg else None,
        "damaged": damaged,
    }


def _report_problem(report: dict) -> str | None:
    """What no preparation writes in the data report's counts (overall and per source), though they may be few."""
    for where, counts in (
        ("", report),
        *((f"sources.{i}.", s) for i, s in enumerate(report.get("sources", []))),
    ):
        if not isinstance(counts, dict):
            return f"{where or 'the report'} is not an object"
        for key in (*COUNTS, "tokens", "max_length"):
            value = counts.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"{where}{key}: {value!r:.40} is not a count"
        if counts.get("kept", 0) > counts.get("rows", counts.get("kept", 0)):
            return f"{where}kept {counts['kept']} of {counts['rows']} rows"
        unrendered = counts.get("unrendered", {})
        if not isinstance(unrendered, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in unrendered.values()
        ):
            return f"{where}unrendered: {unrendered!r:.40} is not a count per field"
    return None


# -- GPUs -----------------------------------------------------------------------------------------------------------
_nvml: object | None = None


_nvml_failed = False


def _nvml_module():
    """pynvml, initialised once per process; None where it is not installed or there is no NVIDIA driver."""
    global _nvml, _nvml_failed
    if _nvml is None and not _nvml_failed:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception:  # not installed, no driver, no device: the page simply has no GPU columns
            _nvml_failed = True
    return _nvml


def gpu_status() -> list[dict]:
    """Utilization (percent over the driver's last sample period) and memory of each GPU on this node."""
    nvml = _nvml_module()
    if nvml is None:
        return []
    gpus = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                pids = sorted({p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)})
            except nvml.NVMLError:
                pids = []
            name = nvml.nvmlDeviceGetName(handle)
            gpus.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "utilization_pct": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    "memory_used_bytes": int(mem.used),
                    "memory_total_bytes": int(mem.total),
                    "pids": pids,
                }
            )
    except nvml.NVMLError:
        return gpus
    return gpus


def _match_gpus(rows: list[dict], gpus: list[dict], cfg: RunConfig | None) -> None:
    """The GPU whose process list holds the shard's worker, else (on the worker's host) its configured index."""
    host = socket.gethostname()
    by_pid = {pid: g for g in gpus for pid in g["pids"]}
    by_index = {g["index"]: g for g in gpus}
    for row in rows:
        gpu = by_pid.get(row["pid"]) if row["pid"] else None
        if gpu is None and cfg is not None and cfg.device == "cuda" and row.get("host") in ("", host):
            index = (cfg.gpus or tuple(range(cfg.shards)))[row["shard"]]
            gpu = by_index.get(index) if row["state"] in ACTIVE_STATES else None
        row["gpu"] = None if gpu is None else {k: v for k, v in gpu.items() if k != "pids"}
