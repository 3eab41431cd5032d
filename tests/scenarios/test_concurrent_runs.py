"""Two runs on one output, in real processes: the second is refused in one line naming the first (its pid and
host), and touches nothing of it: the first finishes with exit 0 and every sample once, its staging and token
files left alone. For ``run`` (the same run dir or another one, started during the first or at the same moment)
and for ``regenerate`` against the project's instant chat endpoint."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from support.chat_servers import InstantServer
from support.cli import (
    RUN_TIMEOUT_S,
    crash_run_args,
    done_count,
    launched,
    launcher_output,
    run_cli,
    wait_for,
    write_mixed_dataset,
)

from hsextract.prepare.rows import read_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer):
    path = write_mixed_dataset(
        tmp_path_factory.mktemp("concurrent-data") / "data.jsonl", tiny_tokenizer, n_chat=120
    )
    return path, [json.loads(line)["id"] for line in open(path)]


def assert_every_sample_once(out: Path, sample_ids: list[str]) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    assert Counter(s for b in manifest["batches"] for s in b["sample_ids"]) == Counter(sample_ids)


def assert_refused_naming_the_first(result, first_pid: int | None = None) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "is being written by another hsextract run (pid " in lines[0], lines[0]
    if first_pid is not None:
        assert f"pid {first_pid} on " in lines[0], lines[0]


@pytest.mark.parametrize("second_run_dir", ["run", "run2"])
def test_a_second_run_on_an_output_being_written_is_refused_and_the_first_finishes_untouched(
    tmp_path, tiny_model, dataset, second_run_dir
):
    args = crash_run_args(tmp_path, tiny_model, dataset[0], shards=1, no_progress=True)
    second = [*args, "--run-dir", tmp_path / second_run_dir]
    with launched(args, tmp_path) as first:
        wait_for(lambda: done_count(tmp_path / "run") >= 2, "two batches done", proc=first, root=tmp_path)
        second_result = run_cli(*second, check=False, timeout=RUN_TIMEOUT_S)
        assert first.poll() is None, (
            "the first run ended before the second was refused: the test proves nothing"
        )
        worker = json.loads((tmp_path / "run" / "progress" / "shard-00000.json").read_text())
        assert first.wait(timeout=RUN_TIMEOUT_S) == 0, launcher_output(tmp_path)
    assert_refused_naming_the_first(second_result)
    assert f"on {worker['host']}" in second_result.stderr
    assert "done:" in launcher_output(tmp_path)
    assert_every_sample_once(tmp_path / "out", dataset[1])


def test_two_identical_runs_started_together_one_runs_the_other_is_refused_in_one_line(
    tmp_path, tiny_model, dataset
):
    args = crash_run_args(tmp_path, tiny_model, dataset[0], shards=1, no_progress=True)
    results = started_together(args, args)
    ran = [r for r in results if r.returncode == 0]
    refused = [r for r in results if r.returncode != 0]
    assert len(ran) == 1 and len(refused) == 1, [(r.returncode, r.stdout, r.stderr) for r in results]
    assert "done:" in ran[0].stdout and "Traceback" not in ran[0].stderr, ran[0].stderr
    assert_refused_naming_the_first(refused[0], ran[0].pid)
    assert_every_sample_once(tmp_path / "out", dataset[1])


def started_together(*commands: list) -> list[subprocess.CompletedProcess]:
    """``hsextract`` with each argument list, started at the same moment; their results, with their pids."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "hsextract.cli", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=RUN_TIMEOUT_S)
        result = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        result.pid = p.pid
        results.append(result)
    return results


def test_two_regenerate_processes_on_one_output_one_answers_every_row_once_the_other_is_refused(tmp_path):
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(40)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "regen"
    # ten rounds of four requests of a second each: the first is still answering when the second starts
    server = InstantServer(model="org/model", delay_s=1.0)
    args = [
        "regenerate",
        "--endpoint",
        server.url,
        "--served-model",
        "org/model",
        "--data",
        data,
        "--output",
        out,
        "--concurrency",
        "4",
    ]
    try:
        results = started_together([*args, "--no-progress"], [*args, "--no-progress"])
    finally:
        server.stop()
    ran = [r for r in results if r.returncode == 0]
    refused = [r for r in results if r.returncode != 0]
    assert len(ran) == 1 and len(refused) == 1, [(r.returncode, r.stdout, r.stderr) for r in results]
    assert refused[0].returncode == 2 and refused[0].stdout == "", refused[0].stdout
    assert refused[0].stderr.strip().count("\n") == 0 and "Traceback" not in refused[0].stderr
    assert f"being written by another hsextract regenerate (pid {ran[0].pid} on " in refused[0].stderr
    assert server.requests == 40  # each row asked once (was: 80 requests, 22 rows written twice)
    written = [row["id"] for chunk in sorted(out.glob("chunk-*.jsonl.*")) for row in read_rows(chunk)]
    assert Counter(written) == Counter(r["id"] for r in rows), written  # every row once
