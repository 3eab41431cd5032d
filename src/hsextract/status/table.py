"""The text tables of ``hsextract status``: one for a run dir's document, one for an output's."""

from __future__ import annotations

from hsextract.prepare.report import COUNTS, DataReport
from hsextract.run.progress import ShardState, format_duration


def run_table(doc: dict) -> str:
    """This node's shards: batches, tokens, rate, ETA, the age of the last progress, and a line on each problem."""
    rows = doc["shards"]
    lines = [
        f"{'shard':>5}  {'state':<22}{'batches':>13}  {'tokens':>21}  {'tok/s':>9}  {'eta':>12}  "
        f"{'last progress':>13}"
    ]
    for r in rows:
        eta = "" if r["eta_s"] is None else format_duration(r["eta_s"])
        rate = r["tokens_per_s"]
        if r["state"] == ShardState.DONE and r.get("elapsed_s"):  # the session's average and length
            eta = f"took {format_duration(r['elapsed_s'])}"
            rate = r.get("average_tokens_per_s") or 0.0
        age = (
            ""
            if r["progress_age_s"] is None or r["state"] == ShardState.DONE
            else format_duration(r["progress_age_s"])
        )
        rate = "damaged" if r["damaged"] else f"{rate:,.0f}"  # the line below says what
        lines.append(
            f"{r['shard']:>5}  {r['state']:<22}{r['batches_done']:>6}/{r['batches_total']:<6}  "
            f"{r['tokens_done']:>10}/{r['tokens_total']:<10}  {rate:>9}  {eta:>12}  "
            f"{age + (' ago' if age else ''):>13}"
        )
        if r["state"] == ShardState.STALLED:
            lines.append(
                f"       {r['stalled_process']} pid {r['stalled_pid']} stalled for "
                f"{format_duration(r['stalled_for_s'])}: {r['stall_reason']}; log: {r['log']}"
            )
        elif r["state"] == ShardState.STOPPED:
            lines.append(
                f"       {r['error'] or 'stopped'}; rerun the same command to resume; log: {r['log']}"
            )
        elif r["state"] in (ShardState.CRASHED, ShardState.FAILED):
            lines.append(f"       {r['error'] or 'no error recorded'}; log: {r['log']}")
        if r["damaged"]:
            lines.append(
                f"       progress file damaged: {r['damaged']} (the worker rewrites it while it runs)"
            )
    done, total = sum(r["tokens_done"] for r in rows), sum(r["tokens_total"] for r in rows)
    verdict = "complete (manifest written)" if doc["complete"] else "not complete"
    lines.append(f"total {done}/{total} tokens; {verdict}")
    return "\n".join(lines + data_lines(doc.get("plan") or {}))


def data_lines(plan: dict) -> list[str]:
    """The data report: what became of the rows, overall and per source (as the run printed it)."""
    damaged = [f"damaged: {problem}" for problem in plan.get("damaged") or []]
    report = plan.get("data_report")
    if not report:
        return damaged
    fields = {name: 0 for name in (*COUNTS, "tokens", "max_length")}
    counts = {**fields, **{k: v for k, v in report.items() if k in fields}}
    sources = [{**fields, **s} for s in plan.get("data_sources") or []]
    unrendered = report.get("unrendered") if isinstance(report.get("unrendered"), dict) else {}
    data = DataReport(**counts, sources=sources, unrendered=unrendered)
    return [f"data: {data.summary()}", *(f"  {line}" for line in data.source_lines()), *damaged]


def output_table(doc: dict) -> str:
    """Every node's shards of a job, from its output alone."""
    lines = [f"{'node':>4} {'shard':>5}  {'state':<28}{'batches':>13}  {'tokens':>21}"]
    for r in doc["shards"]:
        lines.append(
            f"{r['node']:>4} {r['shard']:>5}  {r['state']:<28}{r['batches_done']:>6}/{r['batches_total']:<6}  "
            f"{r['tokens_done']:>10}/{r['tokens_total']:<10}"
        )
    done = sum(r["tokens_done"] for r in doc["shards"])
    total = sum(r["tokens_total"] for r in doc["shards"])
    verdict = "complete (manifest written)" if doc["complete"] else "not complete"
    lines.append(f"total {done}/{total} tokens over {doc['nodes']} node(s); {verdict}")
    return "\n".join(lines)
