"""A staged batch file altered while the run is live, between its writing and its upload: the uploader checks the
bytes it sends against the CRC32 the writer computed, refuses the file, and the run stops naming it; nothing is
recorded for the batch, and the rerun recomputes it. On a local output and on S3 (SeaweedFS on loopback).

The uploader is frozen (SIGSTOP) before its first upload, one staged file gets one byte flipped, then the uploader
is continued: a real change of a real file under a live run, not raced.
"""

import os
import signal
from pathlib import Path

import pytest
from support.cli import batch_bytes, launched, launcher_output, rehomed_args, run_cli, wait_for
from support.damage import flip
from support.procs import freeze
from support.s3server import cli_env

from hsextract.config import run_staging_dir
from hsextract.output.records import done_key
from hsextract.run.progress import ShardProgress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("aws_test_env")]

PREFIX = "staged"


def staged_files(staging: Path) -> list[Path]:
    """Complete staged files (a write in progress has a temporary name)."""
    return (
        sorted(p for p in staging.glob("*.safetensors") if ".tmp" not in p.name) if staging.is_dir() else []
    )


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_staged_file_changed_before_its_upload_is_refused_by_name_and_recomputed(
    store, tmp_path, finished_run, request
):
    """Was: uploaded as it was, vouched for by its completion record, listed in the manifest."""
    if store == "s3":
        s3 = request.getfixturevalue("s3")
        bucket = request.getfixturevalue("s3_bucket")
        output = {"output": f"s3://{bucket}/{PREFIX}", "s3_endpoint_url": s3.url}
    else:
        output = {}
    args = rehomed_args(finished_run[3], tmp_path, num_proc=1, **output)
    run_dir = tmp_path / "run"
    staging = run_staging_dir(tmp_path / "staging", run_dir) / "shard-00000"
    with launched(args, tmp_path, env=cli_env()) as proc:
        progress = wait_for(
            lambda: (p := ShardProgress.load(run_dir, 0)) and p.uploader_pid and p,
            "shard 0's uploader",
            proc=proc,
            root=tmp_path,
        )
        freeze(progress.uploader_pid)  # before the model has loaded: nothing of shard 0 is uploaded yet
        staged = wait_for(lambda: staged_files(staging), "a staged file", proc=proc, root=tmp_path)[0]
        flip(staged, staged.stat().st_size // 2)  # in the states; the size is unchanged
        os.kill(progress.uploader_pid, signal.SIGCONT)
        assert proc.wait(timeout=180) == 1, launcher_output(tmp_path)
    text = launcher_output(tmp_path)
    assert "Traceback" not in text, text
    assert (
        f"shard 0 failed (exit 2): the uploader process exited with status 1: {staged} changed after it was written"
        in text
    )
    assert f"recomputes shard-00000/{staged.name}" in text, text
    key = f"shard-00000/{staged.name}"
    if store == "s3":
        objects = set(s3.object_keys(bucket))
        assert f"{PREFIX}/{done_key(key)}" not in objects and f"{PREFIX}/{key}" not in objects
        assert f"{PREFIX}/manifest.json" not in objects
    else:
        assert not (tmp_path / "out" / done_key(key)).exists() and not (tmp_path / "out" / key).exists()
        assert not (tmp_path / "out" / "manifest.json").exists()
    assert not staged.exists()  # deleted, so that the rerun recomputes it rather than trying it again

    rerun = run_cli(*args, env=cli_env())
    assert "done:" in rerun.stdout, rerun.stdout
    reference = batch_bytes(finished_run[0] / "out")
    if store == "s3":
        assert {k: s3.get_object(bucket, f"{PREFIX}/{k}") for k in reference} == reference
    else:
        assert batch_bytes(tmp_path / "out") == reference
    verify = run_cli(
        "verify",
        output.get("output", tmp_path / "out"),
        *(["--s3-endpoint-url", s3.url] if store == "s3" else []),
        env=cli_env(),
        check=False,
    )
    assert verify.returncode == 0 and "all good" in verify.stdout, verify.stdout + verify.stderr
