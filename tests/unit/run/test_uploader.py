"""The uploader process against a local directory and a real S3 server (SeaweedFS): outages, kills, records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.s3server import S3Endpoint, free_port

from hsextract.errors import UploaderDied
from hsextract.output.ledger import claim_output, done_in_output, read_done
from hsextract.run.uploader import Uploader
from hsextract.storage import open_sink

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("aws_test_env")]  # real uploader processes


def _key(i: int) -> str:
    return f"shard-00000/batch-{i:06d}.safetensors"


def _stage(staging: Path, indices: range, size: int = 200_000) -> dict[str, tuple[Path, bytes]]:
    """Staged files with distinct content, one of them empty."""
    staging.mkdir(parents=True, exist_ok=True)
    staged = {}
    for i in indices:
        data = os.urandom(size + i * 1000) if i else b""
        path = staging / f"batch-{i:06d}.safetensors"
        path.write_bytes(data)
        staged[_key(i)] = (path, data)
    return staged


PLAN_HASH = "0123456789abcdef"


def _uploader(tmp_path: Path, output: str, endpoint_url: str | None, *, claim=True, **kwargs) -> Uploader:
    """An uploader of the job ``PLAN_HASH``, which claims the output first; ``claim=False``: the transfer alone."""
    if claim:
        claim_output(open_sink(output, endpoint_url), {"plan_hash": PLAN_HASH})
    return Uploader(
        output=output,
        endpoint_url=endpoint_url,
        log_file=tmp_path / "logs" / "uploader-00000.log",
        plan_hash=PLAN_HASH if claim else "",
        **kwargs,
    )


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _assert_uploaded(output: str, endpoint_url: str | None, staged: dict) -> None:
    """Every staged file is in the output with its completion record, and gone from staging."""
    sink = open_sink(output, endpoint_url)
    assert sink.list_keys("shard-") == sorted(staged)
    assert done_in_output(sink) == set(staged)
    for key, (path, data) in staged.items():
        assert sink.get_bytes(key) == data, key
        record = read_done(sink, key)
        assert (record["size"], record["plan_hash"]) == (len(data), PLAN_HASH)
        assert not path.exists(), f"staged {path.name} not removed"


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_uploader_uploads_every_staged_file_once(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "s3":
        endpoint: S3Endpoint = request.getfixturevalue("s3")
        output, endpoint_url = f"s3://{request.getfixturevalue('s3_bucket')}/run", endpoint.url
    else:
        output, endpoint_url = str(tmp_path / "out"), None
    staged = _stage(tmp_path / "staging", range(12))
    uploader = _uploader(tmp_path, output, endpoint_url, concurrency=3)
    uploader.start()
    done = []
    for key, (path, _data) in staged.items():
        uploader.submit(path, key)
        done += uploader.poll_done()
    done += uploader.close(timeout=60)
    assert sorted(done) == sorted(staged), "each key reported exactly once"
    _assert_uploaded(output, endpoint_url, staged)
    assert list((tmp_path / "staging").iterdir()) == []
    log = (tmp_path / "logs" / "uploader-00000.log").read_text()
    assert log.count("uploaded shard-00000/batch-") == 12
    assert "MB/s" in log


def test_uploader_survives_an_endpoint_outage(s3: S3Endpoint, s3_bucket: str, tmp_path: Path) -> None:
    output = f"s3://{s3_bucket}/run"
    before = _stage(tmp_path / "staging", range(4))
    during = _stage(tmp_path / "staging", range(4, 10))
    uploader = _uploader(tmp_path, output, s3.url)
    uploader.start()
    done = []
    for key, (path, _data) in before.items():
        uploader.submit(path, key)
    _wait_for(lambda: done.extend(uploader.poll_done()) or len(done) == 4, 30, "the first uploads")

    s3.stop()
    for key, (path, _data) in during.items():
        uploader.submit(path, key)
    time.sleep(3)
    assert uploader.poll_done() == [], "nothing can be confirmed while the endpoint is down"
    uploader.check_alive()
    s3.start()

    done += uploader.close(timeout=60)
    assert sorted(done) == sorted(before | during), "each key reported exactly once"
    _assert_uploaded(output, s3.url, before | during)
    assert "retry" in (tmp_path / "logs" / "uploader-00000.log").read_text()


def test_killed_uploader_is_reported_and_a_new_one_finishes_its_files(
    s3: S3Endpoint, s3_bucket: str, tmp_path: Path
) -> None:
    output = f"s3://{s3_bucket}/run"
    staged = _stage(tmp_path / "staging", range(3))
    log_file = tmp_path / "logs" / "uploader-00000.log"
    # An endpoint that refuses connections keeps the uploads in their retry loop.
    stuck = _uploader(tmp_path, output, f"http://127.0.0.1:{free_port()}", claim=False)
    stuck.start()
    for key, (path, _data) in staged.items():
        stuck.submit(path, key)
    _wait_for(lambda: log_file.exists() and "retry" in log_file.read_text(), 30, "a retry in the log")
    stuck.check_alive()

    os.kill(stuck.pid, signal.SIGKILL)
    with pytest.raises(UploaderDied, match=f"killed by SIGKILL.*{log_file}"):
        _wait_for(lambda: stuck.check_alive() and False, 10, "check_alive to raise")
    with pytest.raises(UploaderDied):
        stuck.close()
    assert all(path.exists() for path, _data in staged.values()), "staged files survive the kill"

    uploader = _uploader(tmp_path, output, s3.url)
    uploader.start()
    for key, (path, _data) in staged.items():
        uploader.submit(path, key)
    assert sorted(uploader.close(timeout=60)) == sorted(staged)
    _assert_uploaded(output, s3.url, staged)


def test_a_file_is_recorded_only_while_the_output_is_claimed_by_its_job(
    s3: S3Endpoint, s3_bucket: str, tmp_path: Path
) -> None:
    output = f"s3://{s3_bucket}/run"
    staged = _stage(tmp_path / "staging", range(1, 2))
    (key, (path, _data)) = next(iter(staged.items()))
    uploader = _uploader(tmp_path, output, s3.url)
    open_sink(output, s3.url).put_bytes(
        "hsextract/job.json", b'{"plan_hash": "another"}'
    )  # claimed by another
    uploader.start()
    uploader.submit(path, key)
    with pytest.raises(UploaderDied, match="now held by another job"):
        uploader.close(timeout=60)
    assert path.exists(), "the staged file stays for its own job"
    assert done_in_output(open_sink(output, s3.url)) == set() and f"run/{key}" not in s3.object_keys(
        s3_bucket
    )


def test_permanent_failure_stops_the_uploader_and_keeps_staged_files(s3: S3Endpoint, tmp_path: Path) -> None:
    staged = _stage(tmp_path / "staging", range(1, 3))
    uploader = _uploader(tmp_path, "s3://no-such-bucket/run", s3.url, claim=False)
    uploader.start()
    for key, (path, _data) in staged.items():
        uploader.submit(path, key)
    log_file = tmp_path / "logs" / "uploader-00000.log"
    with pytest.raises(UploaderDied, match=f"status 1: bucket 'no-such-bucket' does not exist.*{log_file}"):
        uploader.close(timeout=30)
    assert all(path.exists() for path, _data in staged.values())
    assert "does not exist" in log_file.read_text()


_PARENT_SCRIPT = """
import sys, time
from pathlib import Path
from hsextract.run.uploader import Uploader

if __name__ == "__main__":
    uploader = Uploader(output=sys.argv[1], endpoint_url=None, log_file=Path(sys.argv[2]))
    uploader.start()
    print(uploader.pid, flush=True)
    time.sleep(120)
"""


def _is_running(pid: int) -> bool:
    """False once the process is gone or a zombie (a container's init may not reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_uploader_dies_with_its_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT_SCRIPT)
    log_file = tmp_path / "uploader.log"
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "out"), str(log_file)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child_pid = int(parent.stdout.readline())
        _wait_for(lambda: log_file.exists() and "uploader started" in log_file.read_text(), 30, "the child")
        assert _is_running(child_pid)
    finally:
        parent.kill()
        parent.wait()
    _wait_for(lambda: not _is_running(child_pid), 10, "the orphaned uploader to die")
