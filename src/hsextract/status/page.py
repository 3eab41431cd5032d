"""The status page: HTML and inline SVG charts rendered from the status document."""

from __future__ import annotations

import html
import string
import time
from importlib import resources
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.run.progress import format_duration
from hsextract.status.document import ACTIVE_STATES, history, status_document

REFRESH_S = 5


CHART_POINTS = 120

"""Time bins of a chart: enough for a smooth line, few enough that the page stays small."""


MIN_BIN_S = 5.0

"""Narrowest bin of a long enough run: tokens become durable a batch at a time, so shorter bins are all spikes."""


MIN_BINS = 12


GAP_MIN_S = 10.0

GAP_FACTOR = 4.0

"""Two history points further apart than ``GAP_FACTOR`` times the shard's usual spacing (and ``GAP_MIN_S``) bound
a stretch in which no worker ran: a live worker saves every second and the history keeps a point every
``history_step_s``."""


COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")


# -- formatting -----------------------------------------------------------------------------------------------------
def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _count(n) -> str:
    return "" if n is None else f"{n:,.0f}"


def _bytes(n) -> str:
    if n is None:
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _duration(s) -> str:
    return "" if s is None else format_duration(s)


def _rate(r) -> str:
    return f"{r:,.0f}" if r else ""


def _bar(done, total) -> str:
    pct = 100.0 * done / total if total else 0.0
    return f'<span class="bar" title="{pct:.1f}%"><i style="width:{pct:.1f}%"></i></span>'


# -- charts ---------------------------------------------------------------------------------------------------------
def _interpolate(points: list[list[float]], col: int, t: float) -> float | None:
    """Value of column ``col`` at time ``t`` between the recorded points; None before the first one."""
    if not points or t < points[0][0]:
        return None
    lo, hi = 0, len(points) - 1
    if t >= points[hi][0]:
        return points[hi][col]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if points[mid][0] <= t:
            lo = mid
        else:
            hi = mid
    (t0, *a), (t1, *b) = points[lo], points[hi]
    v0, v1 = a[col - 1], b[col - 1]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def _gaps(points: list[list[float]]) -> list[tuple[float, float]]:
    """The stretches between two history points in which no worker of the shard ran (stopped, crashed, not yet
    resumed): points much further apart than the shard's usual spacing (``GAP_FACTOR``)."""
    steps = sorted(b[0] - a[0] for a, b in zip(points, points[1:], strict=False))
    if not steps:
        return []
    limit = max(GAP_MIN_S, GAP_FACTOR * steps[len(steps) // 2])
    return [(a[0], b[0]) for a, b in zip(points, points[1:], strict=False) if b[0] - a[0] > limit]


def chart_series(doc: dict, hist: dict[int, list[list[float]]]) -> dict:
    """Tokens/s per shard and in total, and staged bytes per shard, on one time grid covering the run so far.

    Rates are differences of the cumulative ``tokens_done`` between grid times, so a downsampled history still
    gives the right average over each bin; a worker that runs and makes no progress reads as zero. Where no worker
    of a shard ran (before its first point, after the last of a shard no longer running, a bin that meets a gap
    between two sessions) its lines have no value: a gap, not a flat line across it. The total is None only where
    every shard's is.
    """
    now = doc["generated_at"]
    series = {}
    for row in doc["shards"]:
        points = sorted(hist.get(row["shard"], []))
        if row["state"] in ACTIVE_STATES and points:
            points.append([now, row["tokens_done"], row["staged_bytes"]])
        if points:
            series[row["shard"]] = points
    t0 = min((p[0][0] for p in series.values()), default=0.0)
    t1 = max((p[-1][0] for p in series.values()), default=0.0)
    if t1 - t0 < 1.0:  # nothing to draw a rate over yet
        return {"times": [], "rates": {}, "total": [], "staged": {}}
    bins = max(MIN_BINS, min(CHART_POINTS, int((t1 - t0) / MIN_BIN_S)))
    times = [t0 + (t1 - t0) * i / bins for i in range(bins + 1)]
    rates, staged = {}, {}
    for shard, points in series.items():
        gaps, end = _gaps(points), points[-1][0] + 1e-6 * max(1.0, t1 - t0)

        def ran(ta: float, tb: float, gaps=gaps, end=end) -> bool:
            return tb <= end and not any(a < tb and ta < b for a, b in gaps)

        done = [_interpolate(points, 1, t) for t in times]
        rates[shard] = [None] + [
            None if a is None or b is None or not ran(ta, tb) else max(0.0, (b - a) / (tb - ta))
            for a, b, ta, tb in zip(done, done[1:], times, times[1:], strict=False)
        ]
        staged[shard] = [_interpolate(points, 2, t) if ran(t, t) else None for t in times]
    total = [None] + [
        None if all(r[i] is None for r in rates.values()) else sum(r[i] or 0.0 for r in rates.values())
        for i in range(1, len(times))
    ]
    return {"times": times, "rates": rates, "total": total, "staged": staged}


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    scale = 10 ** len(str(int(v))) / 10
    for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if v <= m * scale:
            return m * scale
    return 10 * scale


def svg_chart(times, lines, *, fmt, hline=None, y_floor=1.0, width=620, height=210) -> str:
    """A line chart: ``lines`` is ``[(label, color, values, stroke width)]`` on ``times``; None breaks a line.
    The y axis runs from 0 to a round number above the data and ``hline``, at least ``y_floor``."""
    left, right, top, bottom = 64, 12, 10, 26
    w, h = width - left - right, height - top - bottom
    values = [v for _, _, vs, _ in lines for v in vs if v is not None]
    if hline is not None:
        values.append(hline[0])
    y_max = _nice_max(max([*values, y_floor]))
    t0, t1 = (times[0], times[-1]) if times else (0.0, 1.0)
    span = max(t1 - t0, 1e-9)

    def x(t):
        return left + w * (t - t0) / span

    def y(v):
        return top + h * (1 - v / y_max)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">'
    ]
    for i in range(5):
        v = y_max * i / 4
        parts.append(
            f'<line x1="{left}" x2="{left + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e1e4e8"/>'
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="11" fill="#6a737d">'
            f"{_esc(fmt(v))}</text>"
        )
    clock = "%H:%M:%S" if span < 600 else "%H:%M" if span < 2 * 86400 else "%m-%d %H:%M"
    for i in range(5):
        t = t0 + span * i / 4
        anchor = "start" if i == 0 else "end" if i == 4 else "middle"
        parts.append(
            f'<text x="{x(t):.1f}" y="{height - 8}" text-anchor="{anchor}" font-size="11" fill="#6a737d">'
            f"{time.strftime(clock, time.localtime(t)) if times else ''}</text>"
        )
    if hline is not None:
        parts.append(
            f'<line x1="{left}" x2="{left + w}" y1="{y(hline[0]):.1f}" y2="{y(hline[0]):.1f}" '
            f'stroke="#cf222e" stroke-dasharray="5 4"><title>{_esc(hline[1])}</title></line>'
        )
    for label, color, vs, stroke in lines:
        segment: list[str] = []
        for t, v in [*zip(times, vs, strict=True), (None, None)]:
            if v is None:
                if len(segment) > 1:
                    parts.append(
                        f'<polyline class="series" data-series="{_esc(label)}" fill="none" stroke="{color}" '
                        f'stroke-width="{stroke}" stroke-linejoin="round" points="{" ".join(segment)}"/>'
                    )
                segment = []
            else:
                segment.append(f"{x(t):.1f},{y(v):.1f}")
    parts.append(
        f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + h}" stroke="#8c959f"/>'
        f'<line x1="{left}" x2="{left + w}" y1="{top + h}" y2="{top + h}" stroke="#8c959f"/></svg>'
    )
    return "".join(parts)


def _legend(lines) -> str:
    return (
        '<div class="legend">'
        + "".join(f'<span><i style="background:{c}"></i>{_esc(label)}</span>' for label, c, _, _ in lines)
        + "</div>"
    )


def _charts(doc: dict, hist: dict) -> str:
    s = chart_series(doc, hist)
    if not s["times"]:
        return '<p class="muted">No rate history yet: the chart starts with the first progress a worker saves.</p>'
    color = {shard: COLORS[i % len(COLORS)] for i, shard in enumerate(sorted(s["rates"]))}
    rate_lines = [(f"shard {k}", color[k], v, 1.5) for k, v in sorted(s["rates"].items())]
    if len(rate_lines) > 1:
        rate_lines.append(("total", "#1d2329", s["total"], 2.5))
    staged_lines = [(f"shard {k}", color[k], v, 1.5) for k, v in sorted(s["staged"].items())]
    budget = doc["plan"].get("staging_max_bytes")
    peak = max((v for vs in s["staged"].values() for v in vs if v is not None), default=0)
    # The budget line only where it is on the same scale as the data: 16 GB would flatten a few MB to nothing.
    hline = (budget, "staging budget per shard") if budget and budget <= 2 * peak else None
    budget_note = (
        f"budget {_bytes(budget)} per shard" + ("" if hline else ", above the scale") if budget else ""
    )
    span = _duration(s["times"][-1] - s["times"][0])
    return (
        '<div class="charts">'
        f'<div class="chart" id="rate-chart"><h3>Tokens/s over time <span class="muted">(last {span})</span></h3>'
        f"{svg_chart(s['times'], rate_lines, fmt=_count)}{_legend(rate_lines)}</div>"
        f'<div class="chart" id="staging-chart"><h3>Staged bytes per shard '
        f'<span class="muted">({budget_note})</span></h3>'
        f"{svg_chart(s['times'], staged_lines, fmt=_bytes, hline=hline, y_floor=1e6)}"
        f"{_legend(staged_lines)}</div></div>"
    )


# -- page -----------------------------------------------------------------------------------------------------------
def _state_badge(state: str, extra: str = "") -> str:
    return f'<span class="state {_esc(state.replace(" ", "-"))}">{_esc(state)}</span>{extra}'


def _shard_row(r: dict) -> str:
    badge = _state_badge(r["state"])
    notes = []
    if r["damaged"]:  # spelled out above the table
        if r["state"] != "damaged":
            badge += " " + _state_badge("damaged")
        notes.append("progress file unreadable")
    if r["state"] == "stalled":
        notes.append(f"{r['stalled_process']} pid {r['stalled_pid']}: {r['stall_reason']}; log: {r['log']}")
    if r["state"] in ("crashed", "failed"):
        notes.append(f"{r['error'] or 'worker process gone, no error recorded'}; log: {r['log']}")
    elif r["error"]:
        notes.append(r["error"])
    gpu = r.get("gpu")
    gpu_cells = (
        f"<td>{gpu['utilization_pct']:.0f}%</td><td>{_bytes(gpu['memory_used_bytes'])} / "
        f"{_bytes(gpu['memory_total_bytes'])}</td>"
        if gpu
        else "<td></td><td></td>"
    )
    lag = r["upload_lag_s"]
    uploads = "" if r["uploads_waiting"] is None else f"{r['uploads_waiting']} / {_duration(lag)}"
    return (
        f'<tr class="shard" data-shard="{r["shard"]}" data-state="{_esc(r["state"])}">'
        f'<td>{r["shard"]}</td><td class="l">{badge}</td>'
        f"<td>{r['batches_done']:,} / {r['batches_total']:,}</td>"
        f"<td>{_bar(r['tokens_done'], r['tokens_total'])}{_count(r['tokens_done'])} / {_count(r['tokens_total'])}</td>"
        f"<td>{_rate(r['tokens_per_s'])}</td><td>{_duration(r['eta_s'])}</td>"
        f"<td>{_bytes(r['staged_bytes']) if r['state'] in ACTIVE_STATES else ''}</td><td>{uploads}</td>"
        f"<td>{'' if r['state'] == 'done' else _duration(r['progress_age_s'])}</td>{gpu_cells}"
        f'<td class="l mono">{_esc(r.get("host", ""))}{":" + str(r["pid"]) if r["pid"] else ""}</td>'
        f'<td class="err">{"<br>".join(_esc(n) for n in notes)}</td></tr>'
    )


def _plan_section(plan: dict) -> str:
    report = plan["data_report"]
    layers = "".join(
        f'<tr><td>{L["id"]}</td><td class="l">{_esc(L["type"])}</td><td class="l">{_esc(L["captures"])}</td>'
        f"<td>{L['hf_output_hidden_states_index']}</td><td>{L['vllm_speculators_id']}</td></tr>"
        for L in plan["layers"]
    )
    data = "".join(f"<dt>{_esc(k.replace('_', ' '))}</dt><dd>{_figure(v)}</dd>" for k, v in report.items())
    return (
        '<h2>Plan</h2><div class="plan"><dl>'
        f'<dt>model</dt><dd class="mono">{_esc(plan["model"])}</dd>'
        f'<dt>output</dt><dd class="mono">{_esc(plan["output"])}</dd>'
        f"<dt>device, dtype</dt><dd>{_esc(plan['device'])}, {_esc(plan['dtype'])}</dd>"
        f"<dt>shards</dt><dd>{plan['shards']}</dd><dt>batches</dt><dd>{_count(plan['batches'])}</dd>"
        f"<dt>samples</dt><dd>{_count(plan['samples'])}</dd><dt>tokens</dt><dd>{_count(plan['tokens'])}</dd>"
        f"<dt>padding waste</dt><dd>{100 * plan['padding_waste']:.2f}%</dd>"
        f'<dt>plan hash</dt><dd class="mono">{_esc(plan["plan_hash"])}</dd></dl>'
        f'<div><table id="layers"><thead><tr><th>layer id</th><th class="l">type</th><th class="l">captured</th>'
        f"<th>HF output_hidden_states</th><th>vLLM / speculators id</th></tr></thead><tbody>{layers}</tbody>"
        f'</table><p class="muted">{plan["num_layers"]} decoder layers, hidden size {plan["hidden_size"]}; '
        f"ids count decoder-layer outputs from 0, before the final norm.</p></div>"
        f'<dl id="data-report"><dt><b>data</b></dt><dd></dd>{data}</dl></div>'
        + "".join(f'<p class="err">damaged: {_esc(problem)}</p>' for problem in plan.get("damaged") or [])
        + _sources_table(plan.get("data_sources", []))
    )


def _figure(value) -> str:
    """A count, or counts by name (``unrendered``: ``reasoning 3``)."""
    if isinstance(value, dict):
        return _esc(", ".join(f"{name} {_count(n)}" for name, n in sorted(value.items())) or "none")
    return _count(value)


def _sources_table(sources: list[dict]) -> str:
    """Per-source counts of a mix (nothing for one source: the data report above is its)."""
    if len(sources) < 2:
        return ""
    columns = ("rows", "kept", "truncated", "skipped_empty", "skipped_malformed", "skipped_too_long")
    columns += ("skipped_duplicate", "tokens")
    head = "".join(f"<th>{c.replace('skipped_', '').replace('_', ' ')}</th>" for c in columns)
    body = "".join(
        f'<tr><td class="l">{_esc(s["name"])}</td><td class="l mono">{_esc(s.get("source", ""))}</td>'
        + "".join(f"<td>{_count(s.get(c, 0))}</td>" for c in columns)
        + "</tr>"
        for s in sources
    )
    return (
        f'<table id="data-sources"><thead><tr><th class="l">source</th><th class="l">from</th>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table>"
    )


def render_body(doc: dict, hist: dict) -> str:
    now = doc["generated_at"]
    t = doc["totals"]
    rows = doc["shards"]
    bad = [r for r in rows if r["state"] in ("crashed", "failed")]
    if doc["complete"]:
        overall = _state_badge("complete")
    elif bad:
        overall = _state_badge("error", f" {len(bad)} shard(s) {'/'.join(sorted({r['state'] for r in bad}))}")
    elif t["states"].keys() & set(ACTIVE_STATES):
        overall = _state_badge("running")
    else:
        overall = _state_badge("not running")
    pct = 100.0 * t["tokens_done"] / t["tokens_total"] if t["tokens_total"] else 0.0
    cards = [
        (f"{pct:.1f}%", f"{_count(t['tokens_done'])} / {_count(t['tokens_total'])} tokens"),
        (f"{t['batches_done']:,} / {t['batches_total']:,}", "batches"),
        (_rate(t["tokens_per_s"]) or "–", "tokens/s"),
        (_duration(t["eta_s"]) or "–", "ETA"),
        (_bytes(t["staged_bytes"]) or "0 B", "staged"),
    ]
    gpu_head = "<th>GPU util</th><th>GPU memory</th>"
    table = (
        '<table id="shards"><thead><tr><th>shard</th><th class="l">state</th><th>batches</th><th>tokens</th>'
        f"<th>tok/s</th><th>ETA</th><th>staged</th><th>uploads waiting / lag</th><th>last progress</th>{gpu_head}"
        '<th class="l">host:pid</th><th class="l">error</th></tr></thead><tbody>'
        + "".join(_shard_row(r) for r in rows)
        + f'</tbody><tfoot><tr><td></td><td class="l">total</td><td>{t["batches_done"]:,} / {t["batches_total"]:,}</td>'
        f"<td>{_bar(t['tokens_done'], t['tokens_total'])}{_count(t['tokens_done'])} / {_count(t['tokens_total'])}</td>"
        f"<td>{_rate(t['tokens_per_s'])}</td><td>{_duration(t['eta_s'])}</td><td>{_bytes(t['staged_bytes'])}</td>"
        '<td></td><td></td><td></td><td></td><td></td><td class="l"></td></tr></tfoot></table>'
    )
    problems = [r for r in rows if r["damaged"]]
    problem_box = (
        '<p class="problem">'
        + "<br>".join(
            f"shard {r['shard']}: progress file damaged: {_esc(r['damaged'])} (done counts come from the output)"
            for r in problems
        )
        + "</p>"
        if problems
        else ""
    )
    return (
        f"<header><h1>hsextract · {_esc(Path(doc['run_dir']).name)}</h1>{overall}"
        f'<span class="path">{_esc(doc["run_dir"])}</span>'
        f'<span class="updated">updated {time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))}</span></header>'
        "<main>"
        + '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="v">{v}</div><div class="k">{k}</div></div>' for v, k in cards
        )
        + "</div><h2>Shards</h2>"
        + problem_box
        + table
        + "<h2>Rate and staging</h2>"
        + _charts(doc, hist)
        + _plan_section(doc["plan"])
        + "</main>"
    )


def _template() -> string.Template:
    return string.Template(resources.files("hsextract.status").joinpath("status_page.html").read_text())


def render_page(run_dir: Path, refresh_s: int = REFRESH_S) -> str:
    """The whole page; a run dir that cannot be read gives a page that says why (and keeps refreshing)."""
    try:
        doc = status_document(run_dir)
        body = render_body(doc, history(run_dir))
        title = f"{Path(run_dir).name}: {100.0 * doc['totals']['tokens_done'] / max(doc['totals']['tokens_total'], 1):.0f}%"
    except HsextractError as e:
        body, title = f'<main><p class="problem">{_esc(e)}</p></main>', "hsextract status"
    return _template().substitute(
        title=_esc(f"{title} · hsextract"), body=body, refresh_s=refresh_s, refresh_ms=refresh_s * 1000
    )
