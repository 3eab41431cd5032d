"""The status document and the rate history, without processes: damaged progress files, the history's bound, the
chart's rates. (The server and the page against a real run are in test_serve.py.)"""

import contextlib
import json
import socket
import sys

import pytest

from hsextract.prepare.plan import make_plan
from hsextract.run.progress import HISTORY_POINTS, ShardProgress
from hsextract.run.rundir import RunDir
from hsextract.status.document import history, status_document
from hsextract.status.page import chart_series, render_body


@pytest.fixture
def run_dir(tmp_path):
    plan = make_plan(
        [100, 90, 80, 70], max_tokens_per_batch=200, max_rows=2, shards=2, fingerprint={"model": "m"}
    )
    plan.save(RunDir(tmp_path).plan_file)
    return tmp_path


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"shard": 1, "state": "runn', "not JSON"),
        ("[1, 2]", "holds a list, not a progress record"),
        ('{"shard": 1, "tokens_dne": 3}', "tokens_dne: unknown key"),
        # Right-typed figures no worker writes (was: `-28 tok/s`, a 30-digit rate, a traceback on the state).
        ('{"shard": 1, "state": "running", "tokens_per_s": -28.0}', "tokens_per_s -28.0 is not a figure"),
        ('{"shard": 1, "state": "running", "tokens_per_s": 1e29}', "tokens_per_s 1e+29 is not a figure"),
        ('{"shard": 1, "state": "sleeping"}', "state 'sleeping' is not one a worker writes"),
        ('{"shard": 1, "tokens_done": -5}', "tokens_done -5 is not a count"),
        ('{"shard": 1, "started_at": 100.0, "updated_at": 50.0}', "updated_at 50.0 is before started_at"),
        ('{"shard": 1, "history": [[1.0, -3, 0]]}', "history point [1.0, -3, 0] is not"),
    ],
)
def test_a_damaged_progress_file_is_named_on_its_row_and_the_page_still_renders(run_dir, text, why):
    ShardProgress(shard=0, state="running", pid=1).save(run_dir)
    path = RunDir(run_dir).progress_file(1)
    path.write_text(text)
    doc = status_document(run_dir)
    shard0, shard1 = doc["shards"]
    assert shard0["damaged"] == ""
    assert shard1["damaged"].startswith(f"{path}: ") and why in shard1["damaged"]
    assert shard1["state"] == "damaged" and shard1["batches_total"] == 1
    hist = history(run_dir)
    assert set(hist) == {0, 1} and hist[1] == []
    page = render_body(doc, hist)
    assert 'data-shard="1" data-state="damaged"' in page and 'data-shard="0"' in page
    assert f"shard 1: progress file damaged: {path}: " in page


def test_history_stays_bounded_for_a_week_and_keeps_its_ends():
    p = ShardProgress(shard=0)
    week = 7 * 24 * 3600
    for t in range(0, week, 1):  # a save a second, as a running worker does
        p.tokens_done = 10 * t
        p._record_history(float(t))
    assert len(p.history) <= HISTORY_POINTS
    assert p.history[0][0] == 0 and p.history[-1] == [week - 1, 10 * (week - 1), 0]
    gaps = {b[0] - a[0] for a, b in zip(p.history[:-2], p.history[1:-1], strict=True)}
    assert gaps == {p.history_step_s}
    assert len(json.dumps(p.history)) < 16_000


def test_history_survives_a_save_and_load(tmp_path):
    p = ShardProgress(shard=3, tokens_done=5)
    p.save(tmp_path)
    p.tokens_done = 9
    p.save(tmp_path)
    assert [pt[1] for pt in ShardProgress.load(tmp_path, 3).history] == [5, 9]


def test_chart_rates_are_per_bin_averages_and_a_gap_reads_as_zero():
    doc = {
        "generated_at": 200.0,
        "shards": [
            {"shard": 0, "state": "done", "tokens_done": 1000, "staged_bytes": 0},
            {"shard": 1, "state": "crashed", "tokens_done": 500, "staged_bytes": 0},
        ],
    }
    hist = {
        0: [[0.0, 0, 0], [100.0, 1000, 10]],  # 10 tokens/s throughout
        1: [[0.0, 0, 0], [50.0, 500, 0], [100.0, 500, 0]],  # 10 tokens/s, then nothing (crashed at 50 s)
    }
    s = chart_series(doc, hist)
    assert s["times"][0] == 0.0 and s["times"][-1] == 100.0
    assert all(r == pytest.approx(10.0) for r in s["rates"][0][1:])
    early = [r for t, r in zip(s["times"], s["rates"][1], strict=True) if r is not None and t <= 50]
    late = [r for t, r in zip(s["times"], s["rates"][1], strict=True) if t > 60]
    assert early and all(r == pytest.approx(10.0) for r in early) and all(r == 0 for r in late)
    assert s["total"][1] == pytest.approx(20.0) and s["total"][-1] == pytest.approx(10.0)


def test_the_chart_leaves_a_gap_where_no_worker_ran_instead_of_a_line_across_it():
    """Shard 0 ran 0-20 s, was stopped, and resumed at 80 s (its history carries on across the restart); shard 1
    ran 0-60 s and finished. Nothing is drawn for shard 0 between 20 and 80 s, nor for shard 1 after 60 s; the
    total is the shards that ran."""
    from hsextract.status.page import svg_chart

    doc = {
        "generated_at": 100.0,
        "shards": [
            {"shard": 0, "state": "done", "tokens_done": 400, "staged_bytes": 0},
            {"shard": 1, "state": "done", "tokens_done": 300, "staged_bytes": 0},
        ],
    }
    first = [[float(t), 10 * t, 0] for t in range(0, 21, 2)]
    second = [[float(t), 200 + 10 * (t - 80), 0] for t in range(80, 101, 2)]
    hist = {0: first + second, 1: [[float(t), 5 * t, 0] for t in range(0, 61, 2)]}
    s = chart_series(doc, hist)
    bins = list(
        zip(s["times"], s["times"][1:], s["rates"][0][1:], s["rates"][1][1:], s["total"][1:], strict=False)
    )
    assert bins
    for ta, tb, r0, r1, total in bins:
        if tb <= 20 or ta >= 80:
            assert r0 == pytest.approx(10.0), (ta, tb)
        elif ta > 20 and tb < 80:
            assert r0 is None, (ta, tb, r0)  # was ~0, drawn flat across the minute nothing ran
        if tb <= 60:
            assert r1 == pytest.approx(5.0), (ta, tb)
        elif ta >= 60:
            assert r1 is None, (ta, tb, r1)
        if 21 < ta and tb < 59:
            assert total == pytest.approx(5.0)
        if 61 < ta and tb < 79:
            assert total is None
    staged0 = [v for t, v in zip(s["times"], s["staged"][0], strict=True) if 21 < t < 79]
    assert staged0 and all(v is None for v in staged0)
    svg = svg_chart(s["times"], [("shard 0", "#000", s["rates"][0], 1.5)], fmt=str)
    assert svg.count('data-series="shard 0"') == 2  # two sessions, two lines


def test_a_crashed_shard_shows_its_state_and_log_on_the_page(run_dir):
    ShardProgress(shard=0, state="running", pid=2**22 + 1, host=socket.gethostname()).save(
        run_dir
    )  # no such pid
    doc = status_document(run_dir)
    assert doc["shards"][0]["state"] == "crashed"
    page = render_body(doc, history(run_dir))
    assert 'data-shard="0" data-state="crashed"' in page and 'class="state error"' in page
    assert f"worker process gone, no error recorded; log: {RunDir(run_dir).log_file(0)}" in page


def test_a_mix_shows_per_source_counts_in_the_document_and_on_the_page(run_dir):
    counts = {"truncated": 0, "skipped_empty": 0, "skipped_malformed": 1, "skipped_too_long": 0}
    sources = [
        {"name": "chat", "source": "convs/*.jsonl", "rows": 3, "kept": 2, **counts, "skipped_duplicate": 0},
        {"name": "tools", "source": "hf:org/tools", "rows": 2, "kept": 1, **counts, "skipped_duplicate": 1},
    ]
    report = {"rows": 5, "kept": 3, "tokens": 340, "sources": sources}
    RunDir(run_dir).data_report_file.write_text(json.dumps(report))

    doc = status_document(run_dir)

    assert [(s["name"], s["kept"], s["skipped_duplicate"]) for s in doc["plan"]["data_sources"]] == [
        ("chat", 2, 0),
        ("tools", 1, 1),
    ]
    page = render_body(doc, history(run_dir))
    table = page[page.index('<table id="data-sources">') :]
    assert '<td class="l">tools</td><td class="l mono">hf:org/tools</td><td>2</td><td>1</td>' in table
    assert table.index("chat") < table.index("tools") and "<th>duplicate</th>" in table


def test_status_names_damaged_run_dir_figures_instead_of_printing_them(run_dir):
    from click.testing import CliRunner

    from hsextract.cli import main

    ShardProgress(shard=0, state="running", pid=1, tokens_per_s=1e29).save(run_dir)
    RunDir(run_dir).data_report_file.write_text(json.dumps({"rows": 5, "kept": -5, "tokens": 340}))
    RunDir(run_dir).info_file.write_text(json.dumps({"layer_ids": ["0", "3"], "num_layers": 8}))
    result = CliRunner().invoke(main, ["status", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "-5 kept" not in result.output and "0" * 20 not in result.output
    lines = result.output.splitlines()
    assert lines[1].split()[:2] == ["0", "damaged"] and lines[1].split()[4] == "damaged"  # the rate column
    assert "tokens_per_s 1e+29 is not a figure a worker writes" in lines[2]
    assert f"damaged: {RunDir(run_dir).data_report_file} is damaged (kept: -5 is not a count)" in lines
    assert any(line.startswith(f"damaged: {RunDir(run_dir).info_file} is damaged (") for line in lines)


def test_status_shows_what_the_chat_template_left_out_and_names_a_damaged_count(run_dir):
    from click.testing import CliRunner

    from hsextract.cli import main
    from hsextract.status.table import data_lines

    source = {"name": "chat", "source": "c.jsonl", "rows": 5, "kept": 5, "unrendered": {"reasoning": 3}}
    report = {"rows": 5, "kept": 5, "tokens": 340, "unrendered": {"reasoning": 3}, "sources": [source]}
    RunDir(run_dir).data_report_file.write_text(json.dumps(report))

    doc = status_document(run_dir)
    assert "reasoning not rendered in 3 rows" in data_lines(doc["plan"])[0]
    assert "reasoning not rendered in 3 rows" in CliRunner().invoke(main, ["status", str(run_dir)]).output
    assert "<dt>unrendered</dt><dd>reasoning 3</dd>" in render_body(doc, history(run_dir))

    RunDir(run_dir).data_report_file.write_text(json.dumps({**report, "unrendered": {"reasoning": -3}}))
    lines = data_lines(status_document(run_dir)["plan"])
    assert any("unrendered: {'reasoning': -3} is not a count per field" in line for line in lines)
    assert not any("-3 rows" in line for line in lines)


def test_a_full_stdout_is_named_as_such_not_as_a_file_to_resume(run_dir, monkeypatch, capsys):
    """``hsextract status RUN > /dev/full``: where stdout goes is full, which no rerun of the job fixes (was:
    "cannot write a file: ... rerun the same command to resume")."""
    from hsextract.cli import main

    full = open("/dev/full", "w")  # a real ENOSPC on every write
    monkeypatch.setattr(sys, "stdout", full)
    with pytest.raises(SystemExit) as exit_:
        main.main(["status", str(run_dir)], standalone_mode=False)
    monkeypatch.undo()
    with contextlib.suppress(OSError):  # what it still holds cannot be written either
        full.close()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "resume" not in err
    assert err.startswith("error: cannot write to standard output: No space left on device (the file it is")
