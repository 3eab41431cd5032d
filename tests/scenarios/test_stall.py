"""Stalls, stops and damaged progress, in real processes with real signals: an uploader or a worker frozen with
SIGSTOP is named by the launcher, the worker's log and ``status`` within a few seconds of the stall timeout, and the
run completes once it is continued; SIGTERM to the launcher stops every worker, says how to resume, and ``status``
says the shards were stopped; a damaged progress file is shown as damaged; a finished run leaves no staging
directory behind.

The stall timeout is 4 s here (``--stall-timeout``) so that the tests take seconds, not the default minutes.
"""

import json
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from support.cli import (
    RUN_TIMEOUT_S,
    copy_finished_run,
    crash_run_args,
    done_count,
    done_keys,
    launched,
    launcher_output,
    run_cli,
    run_logs,
    status,
    status_json,
    wait_for,
    write_mixed_dataset,
)
from support.procs import descendants, wait_dead

from hsextract.config import run_staging_dir
from hsextract.output import Plan
from hsextract.output.manifest import SAMPLE_INDEX
from hsextract.output.records import done_key
from hsextract.run.progress import ShardProgress
from hsextract.run.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STALL_TIMEOUT_S = 4
REPORT_WITHIN_S = STALL_TIMEOUT_S + 10
"""A stall is reported by then: the timeout, plus a tick of the worker and of the launcher, on a loaded machine.
The timeout is a few times the 1 s refresh of a live worker, so that a process merely starved of CPU on a loaded
2-core machine is not reported stalled."""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer):
    path = write_mixed_dataset(
        tmp_path_factory.mktemp("stall-data") / "data.jsonl", tiny_tokenizer, n_chat=60
    )
    return path, [json.loads(line)["id"] for line in open(path)]


def stall_args(root: Path, model, data) -> list[str]:
    return crash_run_args(root, model, data, stall_timeout=STALL_TIMEOUT_S)


def progress(run_dir: Path, shard: int) -> ShardProgress | None:
    return ShardProgress.load(run_dir, shard)


def running(run_dir: Path, shard: int) -> ShardProgress | None:
    """The shard's progress once its worker computes and its uploader has marked a batch."""
    p = progress(run_dir, shard)
    return p if p and p.uploader_pid and done_count(run_dir, shard) else None


def done(run_dir: Path, shard: int) -> ShardProgress | None:
    p = progress(run_dir, shard)
    return p if p and p.state == "done" else None


def assert_complete(root: Path, sample_ids: list[str]) -> None:
    """The manifest lists every planned batch once and every sample once; the output holds exactly those files, a
    completion record for each, and the run's staging directory is gone (the --staging root given is the user's:
    kept)."""
    out, run_dir = root / "out", root / "run"
    manifest = json.loads((out / "manifest.json").read_text())
    keys = [b["key"] for b in manifest["batches"]]
    assert sorted(keys) == sorted(b.key for b in Plan.load(run_dir / "plan.json").batches)
    assert Counter(s for b in manifest["batches"] for s in b["sample_ids"]) == Counter(sample_ids)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    # The job's bookkeeping (claim, completion records) lives under hsextract/; test_resume checks it byte for byte.
    assert [f for f in files if not f.startswith("hsextract/")] == sorted(
        [*keys, "manifest.json", SAMPLE_INDEX]
    )
    assert done_keys(run_dir) == set(keys)
    staging = run_staging_dir(str(root / "staging"), run_dir)
    assert not staging.exists(), f"staging left behind: {list(staging.rglob('*'))}"


def wait_for_line(text: str, proc, root: Path, timeout: float = REPORT_WITHIN_S) -> float:
    """Seconds until the launcher printed ``text``."""
    t0 = time.monotonic()
    wait_for(lambda: text in launcher_output(root), repr(text), proc=proc, root=root, timeout=timeout)
    return time.monotonic() - t0


# -- an uploader frozen with SIGSTOP ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uploader_stopped(tmp_path_factory, tiny_model, dataset):
    root = tmp_path_factory.mktemp("stop-uploader")
    run_dir = root / "run"
    seen: dict = {}
    with launched(stall_args(root, tiny_model, dataset[0]), root) as proc:
        p = wait_for(lambda: running(run_dir, 0), "shard 0 running", proc=proc, root=root)
        seen["worker"], seen["uploader"] = p.pid, p.uploader_pid
        os.kill(seen["uploader"], signal.SIGSTOP)
        seen["stopped_at"] = time.monotonic()
        seen["done_at_stop"] = done_count(run_dir, 0)
        seen["report_s"] = wait_for_line(f"shard 0: uploader pid {seen['uploader']} stalled", proc, root)
        time.sleep(0.5)
        seen["status"] = status_json(run_dir)
        seen["status_text"] = status(run_dir).stdout
        seen["done_while_stopped"] = done_count(run_dir, 0)
        os.kill(seen["uploader"], signal.SIGCONT)
        seen["rc"] = proc.wait(timeout=RUN_TIMEOUT_S)
    seen["output"] = launcher_output(root)
    return root, seen


def test_stopped_uploader_is_printed_by_the_launcher_naming_shard_and_pid(uploader_stopped):
    root, seen = uploader_stopped
    # Progress bars share the output file: a printed line may follow a bar on the same line.
    line = next(ln for ln in seen["output"].splitlines() if f"uploader pid {seen['uploader']} stalled" in ln)
    assert f"shard 0: uploader pid {seen['uploader']} stalled: no heartbeat for " in line
    assert "SIGSTOP" in line and "shard-00000.uploader.log" in line, line
    assert seen["report_s"] < REPORT_WITHIN_S
    assert seen["output"].count(f"uploader pid {seen['uploader']} stalled") == 1, "a stall is printed once"
    assert f"shard 0: uploader pid {seen['uploader']} recovered" in seen["output"]


def test_stopped_uploader_is_warned_in_the_worker_log(uploader_stopped):
    root, seen = uploader_stopped
    log = (root / "run" / "logs" / "shard-00000.log").read_text()
    warning = next(ln for ln in log.splitlines() if "WARNING" in ln and "stalled:" in ln)
    assert f"uploader pid {seen['uploader']} stalled: no heartbeat" in warning
    assert f"uploader pid {seen['uploader']} recovered" in log


def test_status_shows_the_stalled_uploader_and_the_age_of_the_last_progress(uploader_stopped):
    root, seen = uploader_stopped
    shard0 = seen["status"]["shards"][0]
    assert shard0["state"] == "stalled", shard0
    assert shard0["stalled_process"] == "uploader" and shard0["stalled_pid"] == seen["uploader"]
    assert shard0["stalled_for_s"] >= STALL_TIMEOUT_S
    assert shard0["pid"] == seen["worker"] and shard0["uploader_pid"] == seen["uploader"]
    assert shard0["progress_age_s"] is not None and shard0["progress_age_s"] >= 0
    assert seen["done_while_stopped"] == seen["done_at_stop"], "a stopped uploader recorded batches"
    assert seen["status"]["shards"][1]["state"] != "stalled"
    row = next(ln for ln in seen["status_text"].splitlines() if ln.split()[:2] == ["0", "stalled"])
    assert row.endswith(" ago"), row
    assert f"uploader pid {seen['uploader']} stalled for" in seen["status_text"]


def test_run_completes_after_the_uploader_is_continued_and_leaves_no_staging(uploader_stopped, dataset):
    root, seen = uploader_stopped
    assert seen["rc"] == 0, seen["output"]
    assert "done:" in seen["output"]
    assert_complete(root, dataset[1])
    assert {row["state"] for row in status_json(root / "run")["shards"]} == {"done"}


# -- a worker frozen with SIGSTOP ------------------------------------------------------------------------------------
def test_stopped_worker_is_named_by_launcher_and_status_and_the_run_completes(tmp_path, tiny_model, dataset):
    run_dir = tmp_path / "run"
    with launched(stall_args(tmp_path, tiny_model, dataset[0]), tmp_path) as proc:
        worker = wait_for(lambda: running(run_dir, 1), "shard 1 running", proc=proc, root=tmp_path).pid
        os.kill(worker, signal.SIGSTOP)
        report_s = wait_for_line(f"shard 1: worker pid {worker} stalled", proc, tmp_path)
        shard1 = status_json(run_dir)["shards"][1]
        os.kill(worker, signal.SIGCONT)
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    output = launcher_output(tmp_path)
    assert report_s < REPORT_WITHIN_S
    line = next(ln for ln in output.splitlines() if f"worker pid {worker} stalled" in ln)
    assert f"shard 1: worker pid {worker} stalled: progress file not refreshed for " in line
    assert "SIGSTOP" in line and "shard-00001.log" in line, line
    assert shard1["state"] == "stalled" and shard1["stalled_process"] == "worker", shard1
    assert shard1["stalled_pid"] == worker and shard1["stalled_for_s"] >= STALL_TIMEOUT_S
    assert shard1["progress_age_s"] >= STALL_TIMEOUT_S
    assert f"shard 1: worker pid {worker} recovered" in output
    assert rc == 0, output
    assert_complete(tmp_path, dataset[1])


# -- SIGTERM to the launcher -----------------------------------------------------------------------------------------
def test_sigterm_to_launcher_stops_workers_says_how_to_resume_and_the_rerun_completes(
    tmp_path, tiny_model, dataset
):
    run_dir = tmp_path / "run"
    args = stall_args(tmp_path, tiny_model, dataset[0])
    with launched(args, tmp_path) as proc:
        # A frozen worker must be stopped too: it is continued so that it can handle the SIGTERM. Shard 1 is frozen
        # as soon as it runs, so that it cannot finish its share while shard 0 starts (as it did on a loaded machine).
        wait_for(lambda: running(run_dir, 1), "shard 1 running", proc=proc, root=tmp_path)
        os.kill(progress(run_dir, 1).pid, signal.SIGSTOP)
        # Shard 0 may finish its whole share between two looks (a finished shard has no uploader any more).
        wait_for(lambda: running(run_dir, 0) or done(run_dir, 0), "shard 0 running", proc=proc, root=tmp_path)
        assert done_count(run_dir) < len(Plan.load(run_dir / "plan.json").batches), "not mid-run"
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    output = launcher_output(tmp_path)
    assert rc == 128 + signal.SIGTERM, output
    assert "terminated by SIGTERM: stopped shard(s) [0, 1]" in output
    assert "Rerun the same command to resume" in output
    assert not wait_dead(family), "processes outlived the stopped launcher"

    rows = status_json(run_dir)["shards"]
    # Shard 1 was frozen mid-run; shard 0 may have finished its share before the signal landed (then it is done).
    stopped = [row for row in rows if row["batches_done"] < row["batches_total"]]
    assert rows[1] in stopped, rows
    assert all(row["state"] == "stopped" and row["error"] == "stopped by SIGTERM" for row in stopped), (
        f"{rows}\n{output}\n{run_logs(run_dir)}"
    )
    assert all(row["state"] == "done" for row in rows if row not in stopped), rows
    text = status(run_dir).stdout
    assert text.count("stopped by SIGTERM; rerun the same command to resume") == len(stopped), text
    assert "crashed" not in text and "no error recorded" not in text

    rerun = run_cli(*args, timeout=RUN_TIMEOUT_S)
    assert "done:" in rerun.stdout
    assert_complete(tmp_path, dataset[1])


# -- damaged progress files ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content, problem",
    [
        ("null", "holds null"),
        (
            json.dumps({"shard": 0, "state": "running", "from_the_future": 1}),
            "from_the_future: unknown key",
        ),
        ("\x00\x17garbage{", "not JSON"),
        (
            json.dumps({"shard": 0, "tokens_done": "many"}),
            "tokens_done: Input should be a valid integer, got 'many'",
        ),
    ],
    ids=["null", "unknown-key", "garbage", "wrong-type"],
)
def test_status_shows_a_damaged_progress_file_as_damaged(tmp_path, uploader_stopped, content, problem):
    root, _ = uploader_stopped
    copy_finished_run(root, tmp_path)
    run_dir = tmp_path / "run"
    # Shard 0 unfinished (one record gone), so that its state comes from the damaged file; shard 1 done.
    (tmp_path / "out" / done_key(Plan.load(run_dir / "plan.json").for_shard(0)[0].key)).unlink()
    (run_dir / "COMPLETE").unlink()
    for shard in (0, 1):
        RunDir(run_dir).progress_file(shard).write_text(content)

    result = status(run_dir, "--json")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    shard0, shard1 = json.loads(result.stdout)["shards"]
    assert shard0["state"] == "damaged" and problem in shard0["damaged"], shard0
    assert str(RunDir(run_dir).progress_file(0)) in shard0["damaged"]
    assert shard0["batches_done"] == shard0["batches_total"] - 1
    assert shard1["state"] == "done" and problem in shard1["damaged"]
    text = status(run_dir)
    assert text.returncode == 0 and "Traceback" not in text.stderr
    assert text.stdout.count("progress file damaged: ") == 2 and problem in text.stdout


# -- what the worker names when batches stop coming, with heartbeats still arriving ---------------------------------
def test_worker_names_uploader_or_itself_when_no_batch_finishes_for_the_timeout(
    tmp_path, uploader_stopped, caplog
):
    """A hung upload (heartbeats arrive, nothing is uploaded) names the uploader; no batch computed with nothing
    waiting for upload names the worker; a batch finished ends the stall. The uploader is a stand-in here: a frozen
    real one stops its heartbeats too, which the tests above cover."""
    import logging
    from types import SimpleNamespace

    from hsextract.run.worker import ShardRun

    caplog.set_level(logging.INFO, logger="hsextract.run.monitor")
    root, _ = uploader_stopped
    shutil.copytree(root / "run", tmp_path / "run")
    run = ShardRun(tmp_path / "run", 0)
    now = time.time()
    monitor = run.monitor
    monitor.uploader = SimpleNamespace(pid=4242, heartbeat_at=now)
    writer = monitor.writer = SimpleNamespace(submitted={run.batches[0].key}, written_at=None, waiting=False)
    monitor.idle_from = now - STALL_TIMEOUT_S - 1
    p = monitor.progress

    p.state = "draining"
    monitor._check_stall(now)
    assert (p.stalled_process, p.stalled_pid, p.stall_reason) == (
        "uploader",
        4242,
        "no batch uploaded (1 waiting)",
    )
    assert p.stalled_since == monitor.idle_from

    p.state, writer.submitted = "running", set()
    monitor._check_stall(now)
    assert (p.stalled_process, p.stalled_pid, p.stall_reason) == ("worker", os.getpid(), "no batch computed")

    p.progress_at = now
    monitor._check_stall(now)
    assert (p.stalled_process, p.stalled_pid, p.stalled_since) == ("", 0, None)
    messages = [r.getMessage() for r in caplog.records]
    assert "shard 0: uploader pid 4242 stalled: no batch uploaded (1 waiting) for 5 s" in messages[0]
    assert "shard 0: uploader pid 4242 recovered after 5 s" in messages
    assert f"shard 0: worker pid {os.getpid()} recovered after 5 s" in messages
