"""Crash-safe resume, in real processes killed for real: a worker, an uploader, the launcher itself, and leftovers
in staging. After each crash the same command is run again, and the output must equal an uninterrupted run's byte
for byte (CPU float32 forwards are deterministic), hold every sample exactly once, and leave staging empty. Also:
a rerun with a changed plan is refused (``--restart`` starts over), ``--only-shards``, and ``hsextract status`` on
live, crashed, finished and non-run directories.

Kill points are pinned, not raced: the victim (or the whole shard) is frozen with SIGSTOP once some but not all
batches are recorded done in the output, the test checks that state, then sends SIGKILL. A frozen worker's uploader is first left to
finish what it was handed, so that it dies idle, between two files: an uploader killed in the middle of copying a
file leaves a partial object in a local output (see ``test_rerun_removes_partial_upload_left_in_output``).
"""

import json
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from safetensors import safe_open
from support.cli import (
    POLL_S,
    RUN_TIMEOUT_S,
    copy_finished_run,
    crash_run_args,
    done_count,
    done_keys,
    launched,
    launcher_output,
    run_cli,
    status,
    status_json,
    wait_for,
    write_mixed_dataset,
)
from support.procs import alive, descendants, wait_dead

from hsextract.config import run_staging_dir
from hsextract.output import Plan, open_output
from hsextract.output.manifest import SAMPLE_INDEX
from hsextract.output.records import JOB, JOB_FILES, done_key
from hsextract.run.progress import ShardProgress
from hsextract.run.rundir import RunDir

# The timeout covers a test's fixtures too: the reference run and one crash-and-resume cycle fit well within it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHARDS = 2
LIVE_STATES = {"starting", "loading", "waiting-for-kernels", "running", "waiting-for-uploader", "draining"}


# -- runs ---------------------------------------------------------------------------------------------------------
def partial_uploads(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.is_file() and ".tmp" in p.name]


def wait_until_uploads_settle(run_dir: Path, out: Path, quiet_s: float = 0.5) -> None:
    """Wait until no completion record has appeared and no upload has been in progress for ``quiet_s``: the uploader is idle."""
    last, since = None, time.monotonic()
    deadline = since + 60
    while time.monotonic() - since < quiet_s:
        state = (done_count(run_dir), bool(partial_uploads(out)))
        if state != last or state[1]:
            last, since = state, time.monotonic()
        assert time.monotonic() < deadline, "the uploads never settled"
        time.sleep(POLL_S)


def worker_pid(run_dir: Path, shard: int) -> int:
    progress = ShardProgress.load(run_dir, shard)
    return progress.pid if progress else 0


def uploader_pid(run_dir: Path, shard: int) -> int:
    """The pid of the shard's current uploader, from the last start line of its log."""
    log = run_dir / "logs" / f"shard-{shard:05d}.uploader.log"
    if not log.exists():
        return 0
    starts = [line for line in log.read_text().splitlines() if "uploader started: pid" in line]
    return int(starts[-1].split("pid ")[1].split(",")[0]) if starts else 0


# -- the output ---------------------------------------------------------------------------------------------------
def output_files(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def assert_same_output_as_reference(root: Path, reference: Path, sample_ids: list[str]) -> None:
    """Every planned sample exactly once, each batch file once and byte-identical to the uninterrupted run's, no
    extra or partial files in the output, a completion record for every batch, nothing left in staging."""
    out, ref = root / "out", reference / "out"
    files = output_files(out)
    assert not partial_uploads(out), f"partial files left in the output: {partial_uploads(out)}"
    manifest = json.loads((out / "manifest.json").read_text())
    keys = [b["key"] for b in manifest["batches"]]
    assert len(keys) == len(set(keys)), "a batch is listed twice in the manifest"
    bookkeeping = sorted([JOB, *JOB_FILES.values(), *(done_key(k) for k in keys)])
    assert files == sorted([*keys, "manifest.json", SAMPLE_INDEX, *bookkeeping]), (
        "the output holds files the manifest does not list, or lacks some"
    )
    listed = Counter(sid for b in manifest["batches"] for sid in b["sample_ids"])
    assert listed == Counter(sample_ids), "samples missing from or repeated in the manifest"
    assert sorted(open_output(out).sample_ids()) == sorted(sample_ids)

    assert files == output_files(ref)
    same_bytes = [*keys, *JOB_FILES.values(), *(done_key(k) for k in keys)]
    differing = [k for k in same_bytes if (out / k).read_bytes() != (ref / k).read_bytes()]
    assert not differing, f"batch files differ from the uninterrupted run's: {differing}"
    assert manifest == json.loads((ref / "manifest.json").read_text())

    assert done_keys(root / "run") == set(keys)
    staged = [p for p in (root / "staging").rglob("*") if p.is_file()]
    assert not staged, f"files left in staging: {staged}"


# -- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer):
    path = write_mixed_dataset(
        tmp_path_factory.mktemp("resume-data") / "data.jsonl", tiny_tokenizer, n_chat=120
    )
    return path, [json.loads(line)["id"] for line in open(path)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, dataset):
    """The uninterrupted run every crashed-and-resumed run must equal."""
    root = tmp_path_factory.mktemp("reference")
    result = run_cli(*crash_run_args(root, tiny_model, dataset[0]), timeout=RUN_TIMEOUT_S)
    assert "done:" in result.stdout
    manifest = json.loads((root / "out" / "manifest.json").read_text())
    # The reference itself: each batch file holds the samples the manifest says, and every sample once.
    for batch in manifest["batches"]:
        with safe_open(str(root / "out" / batch["key"]), framework="pt") as f:
            assert json.loads(f.metadata()["sample_ids"]) == batch["sample_ids"]
    assert Counter(s for b in manifest["batches"] for s in b["sample_ids"]) == Counter(dataset[1])
    batches = Plan.load(root / "run" / "plan.json").batches
    assert min(sum(b.shard == s for b in batches) for s in range(SHARDS)) >= 20, (
        "too few batches to kill mid-run"
    )
    return root


# -- (a) a worker killed mid-run; status while it runs and after it crashed ------------------------------------------
@pytest.fixture(scope="module")
def worker_killed(tmp_path_factory, tiny_model, dataset):
    root = tmp_path_factory.mktemp("kill-worker")
    run_dir = root / "run"
    args = crash_run_args(root, tiny_model, dataset[0])
    seen: dict = {}
    with launched(args, root) as proc:
        wait_for(
            lambda: worker_pid(run_dir, 0) and worker_pid(run_dir, 1), "both workers", proc=proc, root=root
        )
        seen["status_starting"] = status_json(run_dir)
        wait_for(lambda: done_count(run_dir, 0), "a first batch of shard 0", proc=proc, root=root)
        pid, uploader = worker_pid(run_dir, 0), uploader_pid(run_dir, 0)
        os.kill(pid, signal.SIGSTOP)
        wait_until_uploads_settle(run_dir, root / "out")
        seen["done_at_kill"] = done_count(run_dir, 0)
        seen["status_live"] = status_json(run_dir)
        os.kill(pid, signal.SIGKILL)
        seen["rc"] = proc.wait(timeout=RUN_TIMEOUT_S)
    seen["output"] = launcher_output(root)
    seen["uploader_left"] = wait_dead([uploader])
    seen["status_crashed"] = status_json(run_dir)
    seen["status_crashed_text"] = status(run_dir).stdout
    seen["rerun"] = run_cli(*args, timeout=RUN_TIMEOUT_S)
    return root, seen


def test_status_shows_live_shards_while_the_run_is_going(worker_killed):
    _, seen = worker_killed
    assert not seen["status_starting"]["complete"]
    assert {row["state"] for row in seen["status_starting"]["shards"]} & LIVE_STATES, seen["status_starting"]
    shard0 = seen["status_live"]["shards"][0]
    assert shard0["state"] in LIVE_STATES - {"starting", "loading"}, shard0
    assert shard0["batches_done"] == seen["done_at_kill"]


def test_worker_killed_mid_run_fails_the_launcher_naming_shard_and_log(worker_killed):
    root, seen = worker_killed
    total = seen["status_live"]["shards"][0]["batches_total"]
    assert 0 < seen["done_at_kill"] < total, "the kill did not fall mid-run"
    assert seen["rc"] == 1, seen["output"]
    assert "shard 0 failed (killed by SIGKILL" in seen["output"]
    assert str(root / "run" / "logs" / "shard-00000.log") in seen["output"]
    assert "shard 1 failed" not in seen["output"]
    assert not seen["uploader_left"], "the uploader outlived its worker"


def test_status_shows_the_killed_shard_as_crashed_with_its_log(worker_killed):
    root, seen = worker_killed
    log = str(root / "run" / "logs" / "shard-00000.log")
    shard0, shard1 = seen["status_crashed"]["shards"]
    assert shard0["state"] == "crashed" and shard0["log"] == log
    assert shard0["batches_done"] == seen["done_at_kill"] < shard0["batches_total"]
    assert shard1["state"] == "done" and shard1["batches_done"] == shard1["batches_total"]
    assert not seen["status_crashed"]["complete"]
    text = seen["status_crashed_text"]
    assert "crashed" in text and f"log: {log}" in text and "not complete" in text


def test_resume_after_worker_kill_writes_each_batch_once_byte_identical(worker_killed, reference, dataset):
    root, seen = worker_killed
    assert "shards already complete: [1]" in seen["rerun"].stdout
    assert "done:" in seen["rerun"].stdout
    assert_same_output_as_reference(root, reference, dataset[1])


# -- (b) the uploader killed while batches remain ------------------------------------------------------------------
def test_uploader_killed_stops_its_worker_and_the_rerun_completes(tmp_path, tiny_model, dataset, reference):
    run_dir = tmp_path / "run"
    args = crash_run_args(tmp_path, tiny_model, dataset[0])
    with launched(args, tmp_path) as proc:
        wait_for(lambda: done_count(run_dir, 0), "a first batch of shard 0", proc=proc, root=tmp_path)
        worker, uploader = worker_pid(run_dir, 0), uploader_pid(run_dir, 0)
        # Freeze the worker so that it hands over no more files; kill its uploader once that is idle.
        os.kill(worker, signal.SIGSTOP)
        wait_until_uploads_settle(run_dir, tmp_path / "out")
        marked = done_count(run_dir, 0)
        assert 0 < marked < len(Plan.load(run_dir / "plan.json").for_shard(0)), (
            "the kill did not fall mid-run"
        )
        os.kill(uploader, signal.SIGKILL)
        os.kill(worker, signal.SIGCONT)
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    output = launcher_output(tmp_path)
    assert rc == 1, output
    died = "the uploader process was killed by SIGKILL"
    assert f"shard 0 failed (exit 2): {died}" in output
    assert str(run_dir / "logs" / "shard-00000.log") in output
    assert died in (run_dir / "logs" / "shard-00000.log").read_text()
    assert not alive(worker)
    assert done_count(run_dir, 0) == marked, "batches were marked after the uploader died"

    shard0 = status_json(run_dir)["shards"][0]
    assert shard0["state"] == "failed" and died in shard0["error"]

    rerun = run_cli(*args, timeout=RUN_TIMEOUT_S)
    assert "done:" in rerun.stdout
    assert_same_output_as_reference(tmp_path, reference, dataset[1])


# -- (c) the launcher killed: its workers die with it ---------------------------------------------------------------
def test_launcher_killed_takes_its_workers_and_the_rerun_completes(tmp_path, tiny_model, dataset, reference):
    run_dir = tmp_path / "run"
    args = crash_run_args(tmp_path, tiny_model, dataset[0])

    def started_uploaders():
        pids = [uploader_pid(run_dir, s) for s in range(SHARDS)]
        return pids if all(pids) else None

    with launched(args, tmp_path) as proc:
        uploaders = wait_for(started_uploaders, "both uploaders", proc=proc, root=tmp_path)
        wait_for(lambda: done_count(run_dir), "a first batch", proc=proc, root=tmp_path)
        workers = [worker_pid(run_dir, s) for s in range(SHARDS)]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        wait_until_uploads_settle(run_dir, tmp_path / "out")
        assert 0 < done_count(run_dir) < len(Plan.load(run_dir / "plan.json").batches), "not mid-run"
        family = descendants(proc.pid)
        assert set(workers) | set(uploaders) <= set(family)
        proc.kill()
        proc.wait(timeout=30)
    assert not wait_dead(family), "processes outlived the launcher"
    assert {row["state"] for row in status_json(run_dir)["shards"]} == {"crashed"}

    rerun = run_cli(*args, timeout=RUN_TIMEOUT_S)
    assert "done:" in rerun.stdout
    assert_same_output_as_reference(tmp_path, reference, dataset[1])


# -- (d) leftovers in staging: a complete file is uploaded, not recomputed; a partial one is discarded --------------
def test_rerun_uploads_complete_staged_file_and_discards_partial_one(
    tmp_path, tiny_model, dataset, reference
):
    copy_finished_run(reference, tmp_path)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    # Undo what a finished run adds, to leave the state a crash leaves: no manifest, two batches of shard 0 neither
    # uploaded nor recorded: one complete in staging (written, not yet uploaded), one cut short while being written.
    (run_dir / "COMPLETE").unlink()
    (out / "manifest.json").unlink()
    staged, partial = Plan.load(run_dir / "plan.json").for_shard(0)[3:5]
    staging = run_staging_dir(tmp_path / "staging", tmp_path / "run") / "shard-00000"
    staging.mkdir(parents=True)
    for batch in (staged, partial):
        (out / done_key(batch.key)).unlink()
        (out / batch.key).unlink()
    shutil.copyfile(reference / "out" / staged.key, staging / Path(staged.key).name)
    full = (reference / "out" / partial.key).read_bytes()
    (staging / f"{Path(partial.key).name}.tmp").write_bytes(full[: len(full) // 2])
    log = run_dir / "logs" / "shard-00000.log"
    log_start = log.stat().st_size

    rerun = run_cli(*crash_run_args(tmp_path, tiny_model, dataset[0]), timeout=RUN_TIMEOUT_S)
    assert "shards already complete: [1]" in rerun.stdout and "done:" in rerun.stdout
    with open(log) as f:
        f.seek(log_start)
        session = f.read()
    total = len(Plan.load(run_dir / "plan.json").for_shard(0))
    assert f"resume: {total - 2} batches done, 1 staged to upload, 1 to compute" in session
    assert f"discarded partial staged file {Path(partial.key).name}.tmp" in session
    assert f"batch {partial.batch_id} written" in session
    assert f"batch {staged.batch_id} written" not in session
    assert_same_output_as_reference(tmp_path, reference, dataset[1])


def test_rerun_removes_partial_upload_left_in_output(tmp_path, tiny_model, dataset, reference):
    copy_finished_run(reference, tmp_path)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    (run_dir / "COMPLETE").unlink()
    (out / "manifest.json").unlink()
    batch = Plan.load(run_dir / "plan.json").for_shard(1)[0]
    (out / done_key(batch.key)).unlink()  # killed while copying: no record yet
    full = (out / batch.key).read_bytes()
    (out / batch.key).unlink()
    (out / f"{batch.key}.tmp-4242-4243").write_bytes(full[: len(full) // 2])  # as LocalSink names it

    run_cli(*crash_run_args(tmp_path, tiny_model, dataset[0]), timeout=RUN_TIMEOUT_S)
    assert_same_output_as_reference(tmp_path, reference, dataset[1])
    assert "discarded 1 unfinished upload" in (run_dir / "logs" / "shard-00001.log").read_text()


# -- a changed plan is refused; --restart starts over --------------------------------------------------------------
def test_rerun_with_changed_plan_is_refused_and_restart_starts_over(tmp_path, tiny_model, dataset, reference):
    copy_finished_run(reference, tmp_path)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    kept = {name: (run_dir / name).read_bytes() for name in ("plan.json", "config.json", "data_report.json")}
    done_before = done_keys(run_dir)

    r = run_cli(
        *crash_run_args(tmp_path, tiny_model, dataset[0], layers="0,3"), check=False, timeout=RUN_TIMEOUT_S
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "holds a different plan" in r.stderr and "layer_ids: [0, 3, 7] -> [0, 3]" in r.stderr
    assert "--restart" in r.stderr
    # Fewer, larger batches: a restart must not leave the previous plan's extra batch files behind.
    changed = crash_run_args(tmp_path, tiny_model, dataset[0], max_rows=16, max_tokens_per_batch=600)
    r = run_cli(*changed, check=False, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "max_rows: 8 -> 16" in r.stderr and "max_tokens_per_batch: 300 -> 600" in r.stderr
    assert "layer_ids" not in r.stderr
    assert {name: (run_dir / name).read_bytes() for name in kept} == kept, (
        "a refused rerun changed the run dir"
    )
    assert done_keys(run_dir) == done_before and (out / "manifest.json").exists()

    r = run_cli(*changed, "--restart", "--yes", timeout=RUN_TIMEOUT_S)  # over a finished output
    assert "--restart: cleared" in r.stdout and "done:" in r.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fingerprint"]["max_rows"] == 16
    keys = [b["key"] for b in manifest["batches"]]
    assert len(keys) < len(Plan.load(reference / "run" / "plan.json").batches)
    bookkeeping = [JOB, *JOB_FILES.values(), *(done_key(k) for k in keys)]
    assert output_files(out) == sorted([*keys, "manifest.json", SAMPLE_INDEX, *bookkeeping]), (
        "files of the previous plan are left over"
    )
    assert done_keys(run_dir) == set(keys)
    assert Counter(s for b in manifest["batches"] for s in b["sample_ids"]) == Counter(dataset[1])
    assert max(len(b["sample_ids"]) for b in manifest["batches"]) > 8
    assert not [p for p in (tmp_path / "staging").rglob("*") if p.is_file()]


# -- --only-shards ------------------------------------------------------------------------------------------------
def test_only_shards_runs_the_chosen_shards_and_the_last_writes_the_manifest(
    tmp_path, tiny_model, dataset, reference
):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    args = crash_run_args(tmp_path, tiny_model, dataset[0])
    r = run_cli(*args, "--only-shards", "1", timeout=RUN_TIMEOUT_S)
    assert "batches still to do" in r.stdout and "no manifest written yet" in r.stdout
    plan = Plan.load(run_dir / "plan.json")
    assert done_keys(run_dir) == {b.key for b in plan.for_shard(1)}
    assert not (out / "manifest.json").exists()
    assert {f.split("/")[0] for f in output_files(out) if not f.startswith("hsextract/")} == {"shard-00001"}
    assert not (run_dir / "logs" / "shard-00000.log").exists()
    rows = status_json(run_dir)
    assert [row["state"] for row in rows["shards"]] == ["not started", "done"] and not rows["complete"]

    r = run_cli(*args, "--only-shards", "0", timeout=RUN_TIMEOUT_S)
    assert "done:" in r.stdout
    assert_same_output_as_reference(tmp_path, reference, dataset[1])


# -- status ---------------------------------------------------------------------------------------------------------
def test_status_of_a_finished_run(reference):
    rows = status_json(reference / "run")
    assert rows["complete"]
    for row in rows["shards"]:
        assert row["state"] == "done" and row["batches_done"] == row["batches_total"] > 0
        assert row["tokens_done"] == row["tokens_total"] > 0
    text = status(reference / "run").stdout
    assert "complete (manifest written)" in text
    assert [line.split()[1] for line in text.splitlines()[1 : 1 + SHARDS]] == ["done"] * SHARDS


@pytest.mark.parametrize("extra", [(), ("--json",)])
def test_status_of_a_directory_that_is_not_a_run(tmp_path, extra):
    r = status(tmp_path, *extra, check=False)
    assert r.returncode == 2
    assert f"error: {tmp_path} is not an hsextract run directory (no plan.json)" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_shard_already_being_run_is_refused(tmp_path, tiny_model, dataset):
    """Two processes must never run one shard: the second one stops with a message naming the holder."""
    import fcntl

    run_dir = tmp_path / "run"
    lock = RunDir(run_dir).lock_file(1)
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on elsewhere")
        held.flush()
        r = run_cli(*crash_run_args(tmp_path, tiny_model, dataset[0]), check=False, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 1
    assert "shard 1" in r.stdout and "already being run by pid 4242 on elsewhere" in r.stdout
    assert (
        not RunDir(run_dir).progress_file(1).exists()
        or "failed" not in RunDir(run_dir).progress_file(1).read_text()
    )


def test_per_turn_rows_with_shared_prefixes_resume_after_a_worker_kill_each_row_once(
    tmp_path, tiny_model, dataset
):
    """``--rows per-turn`` on the CPU's stock forward: batches of whole conversations, each shared prefix computed
    once. A worker killed after its first recorded batch, then the same command again: every turn row once, the
    batch files byte-identical to an uninterrupted run's."""
    ref_root, root = tmp_path / "ref", tmp_path / "crash"
    root.mkdir()
    ref_args = crash_run_args(ref_root, tiny_model, dataset[0], rows="per-turn", shards=1)
    run_cli(*ref_args, timeout=RUN_TIMEOUT_S)
    manifest = json.loads((ref_root / "out" / "manifest.json").read_text())
    assert manifest["fingerprint"]["share_prefixes"] is True
    turn_rows = [sid for b in manifest["batches"] for sid in b["sample_ids"]]
    assert sum("#t2" in sid for sid in turn_rows) >= 10  # conversations of several turns
    assert len(manifest["batches"]) >= 4

    args = crash_run_args(root, tiny_model, dataset[0], rows="per-turn", shards=1)
    run_dir = root / "run"
    with launched(args, root) as proc:
        wait_for(lambda: done_count(run_dir, 0), "a first batch", proc=proc, root=root)
        pid = worker_pid(run_dir, 0)
        os.kill(pid, signal.SIGSTOP)
        wait_until_uploads_settle(run_dir, root / "out")
        assert 0 < done_count(run_dir, 0) < len(manifest["batches"])
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=RUN_TIMEOUT_S) != 0
    run_cli(*args, timeout=RUN_TIMEOUT_S)
    assert_same_output_as_reference(root, ref_root, turn_rows)
