"""The commands that read an output, given a place that does not exist or an endpoint that never answers: one
message each, in seconds, through the real CLI."""

from __future__ import annotations

import threading
import time

import pytest
from click.testing import CliRunner
from support.s3server import S3Endpoint, free_port

from hsextract.cli import main
from hsextract.errors import HsextractError
from hsextract.output import open_output, read_manifest
from hsextract.storage import open_sink

pytestmark = pytest.mark.usefixtures("aws_test_env")


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["verify"],
        ["finalize"],
        ["export", "--format", "speculators", "DEST"],
    ],
    ids=["status", "verify", "finalize", "export"],
)
def test_a_read_command_fails_in_seconds_naming_an_endpoint_that_refuses_connections(command, tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"
    args = [command[0], "s3://bucket/run1", *[str(tmp_path / a) if a == "DEST" else a for a in command[1:]]]
    start = time.monotonic()
    result = _cli(*args, "--s3-endpoint-url", endpoint)
    took = time.monotonic() - start
    assert result.exit_code == 2, result.output
    assert endpoint in result.output and "--s3-endpoint-url" in result.output, result.output
    assert "Traceback" not in result.output
    assert took < 20, f"{command[0]} took {took:.0f} s to give up on a refused endpoint"


@pytest.fixture
def silent_endpoint():
    """An endpoint that accepts connections (the kernel completes them) and never answers a byte."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.parametrize("command", ["status", "verify", "export"])
def test_a_read_command_says_what_it_waits_for_and_gives_up_on_an_endpoint_that_never_answers(
    command, silent_endpoint, tmp_path, monkeypatch
):
    from hsextract.storage import s3

    # The same logic on a shorter clock: 30 s and 3 s in a real run (checked below).
    monkeypatch.setattr(s3, "FIRST_CONTACT_S", 1.0)
    monkeypatch.setattr(s3, "READING_ATTEMPTS", 1)
    monkeypatch.setattr(s3, "WAIT_NOTICE_S", 0.2)
    extra = ["--format", "speculators", str(tmp_path / "d")] if command == "export" else []
    start = time.monotonic()
    result = _cli(command, "s3://demo-bucket/run1", *extra, "--s3-endpoint-url", silent_endpoint)
    took = time.monotonic() - start
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"waiting for the S3 endpoint {silent_endpoint} to answer"), lines
    assert "s3://demo-bucket/run1" in lines[0] and "giving up after ~1 s" in lines[0]
    assert f"error: the S3 endpoint {silent_endpoint} gave no answer" in lines[-1], lines
    assert "--s3-endpoint-url" in lines[-1] and "Traceback" not in result.output
    assert took < 8, f"{command} took {took:.0f} s to give up"


def test_a_reading_sink_gives_up_a_first_contact_within_30_s_and_a_writing_one_waits():
    from hsextract.storage import s3

    url = f"http://127.0.0.1:{free_port()}"
    reading = open_sink("s3://b/p", url, reading=True)._client.meta.config
    attempts = reading.retries["total_max_attempts"]
    assert reading.read_timeout * attempts <= s3.FIRST_CONTACT_S <= 30
    assert reading.connect_timeout * attempts <= 30 and s3.WAIT_NOTICE_S <= 5
    writing = open_sink("s3://b/p", url)._client.meta.config
    assert writing.read_timeout == 120  # an upload's long waits on a busy store are not cut short


def test_open_output_fails_at_once_on_an_endpoint_never_reached():
    endpoint = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(HsextractError, match="--s3-endpoint-url"):
        open_output("s3://bucket/run1", endpoint)
    assert time.monotonic() - start < 20


@pytest.mark.slow  # waits out an outage / runs every reader against the server
def test_a_reading_sink_that_reached_its_endpoint_waits_out_an_outage(s3: S3Endpoint, s3_bucket: str):
    sink = open_sink(f"s3://{s3_bucket}/run1", s3.url, retry_deadline_s=60, reading=True)
    sink.put_bytes("a", b"123")
    s3.stop()
    restart = threading.Timer(2.0, s3.start)
    restart.start()
    try:
        assert sink.get_bytes("a") == b"123"  # retried until the endpoint came back
    finally:
        restart.join()


@pytest.mark.parametrize("command", ["verify", "status", "export", "finalize"])
def test_a_missing_directory_is_named_as_missing_not_as_an_unfinished_run(command, tmp_path):
    missing = tmp_path / "no-such-output"
    args = [command, str(missing)] + (
        ["--format", "speculators", str(tmp_path / "d")] if command == "export" else []
    )
    result = _cli(*args)
    assert result.exit_code == 2, result.output
    assert f"the directory {missing} does not exist" in result.output
    assert "manifest" not in result.output


@pytest.mark.slow  # waits out an outage / runs every reader against the server
def test_a_missing_bucket_and_a_missing_prefix_are_named_by_every_reader(
    s3: S3Endpoint, s3_bucket: str, tmp_path
):
    cases = {
        "s3://no-such-bucket/run1": "bucket 'no-such-bucket' does not exist",
        f"s3://{s3_bucket}/no-such-run": f"the prefix 'no-such-run' does not exist in bucket '{s3_bucket}'",
    }
    for url, message in cases.items():
        for args in (
            ["verify", url],
            ["status", url],
            ["export", url, str(tmp_path / "d"), "--format", "speculators"],
        ):
            result = _cli(*args, "--s3-endpoint-url", s3.url)
            assert result.exit_code == 2, result.output
            assert message in result.output, (args, result.output)
            assert "manifest" not in result.output
        with pytest.raises(HsextractError, match=message):
            open_output(url, s3.url)
        with pytest.raises(HsextractError, match=message):
            read_manifest(open_sink(url, s3.url))
