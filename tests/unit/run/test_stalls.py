"""Stalls judged from what each watcher sees (run/stalls.py): the worker's own view, a progress file's, and
the launcher's lines, each a stall named once and its recovery once."""

from types import SimpleNamespace

import pytest

from hsextract.run.progress import ShardProgress
from hsextract.run.rundir import RunDir
from hsextract.run.stalls import STARTUP_GRACE_S, Stall, StallWatch, find_stall, same_stall, worker_stall

NOW, TIMEOUT = 10_000.0, 60.0


def seen(**overrides):
    """A running worker with batches left, a live uploader, everything recent."""
    facts = dict(
        now=NOW,
        timeout=TIMEOUT,
        state="running",
        batches_left=3,
        last_progress_at=NOW - 5,
        uploads_waiting=0,
        uploader_pid=200,
        uploader_heartbeat_at=NOW - 1,
        worker_pid=100,
    )
    return worker_stall(**{**facts, **overrides})


def test_a_busy_worker_with_recent_progress_and_heartbeats_is_not_stalled():
    assert seen() == (None, NOW)


def test_a_silent_uploader_is_named_since_its_last_heartbeat_whatever_the_worker_does():
    for state in ("loading", "running", "draining"):
        stall, since = seen(state=state, uploader_heartbeat_at=NOW - TIMEOUT - 1)
        assert (
            stall == Stall("uploader", 200, NOW - TIMEOUT - 1, "no heartbeat") and since == NOW - TIMEOUT - 1
        )


def test_no_batch_for_the_timeout_is_the_uploaders_stall_while_uploads_wait_else_the_workers():
    old = NOW - TIMEOUT - 1
    stall, since = seen(last_progress_at=old, uploads_waiting=2)
    assert stall == Stall("uploader", 200, old, "no batch uploaded (2 waiting)") and since == old
    stall, _ = seen(last_progress_at=old)
    assert stall == Stall("worker", 100, old, "no batch computed")
    stall, _ = seen(last_progress_at=old, uploads_waiting=2, uploader_pid=None)  # no uploader to blame
    assert stall.process == "worker"


@pytest.mark.parametrize(
    "overrides",
    [
        {"state": "loading"},  # the model loads: no batch is due yet
        {"state": "waiting-for-kernels"},
        {"batches_left": 0},
        {"last_progress_at": NOW - TIMEOUT},  # exactly the timeout is not over it
    ],
    ids=["loading", "kernels", "nothing-left", "at-the-timeout"],
)
def test_no_stall_while_no_batch_is_due_or_within_the_timeout(overrides):
    assert seen(**{"last_progress_at": NOW - TIMEOUT - 100, **overrides}) == (None, NOW)


def test_one_stall_seen_twice_is_the_same_process_whatever_its_reason():
    a = Stall("uploader", 7, 1.0, "no heartbeat")
    assert same_stall(a, Stall("uploader", 7, 5.0, "no batch uploaded (1 waiting)"))
    assert not same_stall(a, Stall("worker", 7, 1.0, "no heartbeat"))
    assert not same_stall(a, None) and same_stall(None, None)


def test_a_progress_file_shows_a_stale_worker_or_what_the_worker_reported():
    p = ShardProgress(shard=0, state="running", pid=100, updated_at=NOW - 10, stall_timeout_s=TIMEOUT)
    assert find_stall(p, NOW) is None
    p.stalled_process, p.stalled_pid, p.stall_reason, p.stalled_since = (
        "uploader",
        200,
        "no heartbeat",
        NOW - 90,
    )
    assert find_stall(p, NOW) == Stall("uploader", 200, NOW - 90, "no heartbeat")
    p.updated_at = NOW - TIMEOUT - 1  # the file itself went stale: the worker is the one stuck
    assert find_stall(p, NOW) == Stall("worker", 100, NOW - TIMEOUT - 1, "progress file not refreshed")
    p.state = "done"  # an ended shard never stalls
    assert find_stall(p, NOW) is None


def test_the_launcher_says_a_stall_once_and_its_recovery_once(tmp_path, monkeypatch):
    clock = [NOW]
    monkeypatch.setattr("hsextract.run.stalls.time.time", lambda: clock[0])
    lines = []
    watch = StallWatch(RunDir(tmp_path), TIMEOUT, lines.append)
    worker = SimpleNamespace(pid=4242_4242)  # no such process: no stop note
    watch.check(0, worker, None)  # no progress file yet, within the grace
    clock[0] += max(TIMEOUT, STARTUP_GRACE_S) + 1
    watch.check(0, worker, None)
    watch.check(0, worker, None)
    assert len(lines) == 1 and "shard 0: worker pid 42424242 stalled: no progress file yet" in lines[0]
    fresh = ShardProgress(
        shard=0, state="running", pid=worker.pid, updated_at=clock[0], stall_timeout_s=TIMEOUT
    )
    watch.check(0, worker, fresh)
    assert len(lines) == 2 and lines[1].startswith("shard 0: worker pid 42424242 recovered after")
    fresh.stalled_process, fresh.stalled_pid, fresh.stall_reason = "uploader", 99, "no heartbeat"
    watch.check(0, worker, fresh)
    assert len(lines) == 3 and "uploader pid 99 stalled: no heartbeat" in lines[2]
    assert str(RunDir(tmp_path).log_file(0, "uploader")) in lines[2]


def test_a_stall_that_ends_with_the_worker_exiting_0_is_said_to_have_recovered(tmp_path, monkeypatch):
    """A worker may finish between two checks (the launcher polls): its shard's stall is not left unsaid."""
    clock = [NOW]
    monkeypatch.setattr("hsextract.run.stalls.time.time", lambda: clock[0])
    lines = []
    watch = StallWatch(RunDir(tmp_path), TIMEOUT, lines.append)
    worker = SimpleNamespace(pid=4242_4242)
    stalled = ShardProgress(
        shard=0, state="running", pid=worker.pid, updated_at=clock[0], stall_timeout_s=TIMEOUT
    )
    stalled.stalled_process, stalled.stalled_pid, stalled.stall_reason = "uploader", 99, "no heartbeat"
    watch.check(0, worker, stalled)
    watch.finished(1)  # another shard, never stalled: nothing to say
    clock[0] += 30
    watch.finished(0)
    watch.finished(0)
    assert len(lines) == 2 and lines[1] == "shard 0: uploader pid 99 recovered after 30 s", lines
