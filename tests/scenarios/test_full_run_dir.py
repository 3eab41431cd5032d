"""A run dir whose file system is full: refused before any work when it is nearly full at the start; when it fills
mid-run, every shard that stops says so in one line (the file, the system's words, the bytes free), exits
non-zero, and ``status`` shows that line. The file system is a real, separately mounted tmpfs (root, as CI has),
filled to the last byte with the run's processes frozen.
"""

import os
import signal
import subprocess
from pathlib import Path

import pytest
from support.cli import (
    batch_bytes,
    done_count,
    launched,
    launcher_output,
    rehomed_args,
    run_cli,
    status,
    wait_for,
)
from support.procs import freeze

from hsextract.run.progress import ShardProgress
from hsextract.run.rundir import RUN_DIR_MIN_FREE_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def mount_tmpfs(where: Path, size: int) -> Path:
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    return where


@pytest.fixture
def run_dir_fs(tmp_path):
    """A file system with room for a tiny run's run dir beyond the floor a run starts with."""
    yield mount_tmpfs(tmp_path / "run-fs", RUN_DIR_MIN_FREE_BYTES + (8 << 20))
    subprocess.run(["umount", "-l", str(tmp_path / "run-fs")], check=False)


@pytest.fixture
def nearly_full_fs(tmp_path):
    yield mount_tmpfs(tmp_path / "small-fs", RUN_DIR_MIN_FREE_BYTES // 2)
    subprocess.run(["umount", "-l", str(tmp_path / "small-fs")], check=False)


def fill(fs: Path) -> Path:
    """Write a file until the file system refuses another byte."""
    ballast = fs / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(bytes(size))
            except OSError:
                pass
    return ballast


def test_a_nearly_full_run_dir_is_refused_before_tokenizing(tmp_path, finished_run, nearly_full_fs):
    run_dir = nearly_full_fs / "run"
    r = run_cli(*rehomed_args(finished_run[3], tmp_path, run_dir=run_dir, num_proc=1), check=False)
    text = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in text, text
    assert f"run dir {run_dir} has " in text and "bytes free on its file system, under the" in text, text
    assert "data:" not in text and not (run_dir / "cache").exists() and not (run_dir / "plan.json").exists()


def test_a_run_dir_filling_mid_run_is_named_with_the_bytes_free_and_status_shows_it(
    tmp_path, finished_run, run_dir_fs
):
    """Was: the launcher printed `with open(tmp,` (the cut-short end of a traceback in the full log), `status`
    said "no error recorded"."""
    run_dir = run_dir_fs / "run"
    args = rehomed_args(finished_run[3], tmp_path, run_dir=run_dir, num_proc=1)
    with launched(args, tmp_path) as proc:
        # Both shards running (each has its progress file and the room it keeps), one batch durable: a shard that
        # had not started yet met the full file system before it could keep room to record its failure.
        def started():
            return done_count(run_dir) >= 1 and all(ShardProgress.load(run_dir, s) for s in (0, 1))

        wait_for(started, "a durable batch, both shards running", proc=proc, root=tmp_path)
        progress = [ShardProgress.load(run_dir, s) for s in (0, 1)]
        pids = [pid for p in progress if p for pid in (p.pid, p.uploader_pid) if pid]
        for pid in pids:
            freeze(pid)
        ballast = fill(run_dir_fs)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        assert proc.wait(timeout=120) == 1, launcher_output(tmp_path)
    text = launcher_output(tmp_path)
    assert "Traceback" not in text and "with open(" not in text, text
    failed = [line for line in text.splitlines() if line.startswith("shard ") and " failed " in line]
    assert failed, text
    for line in failed:
        assert f"cannot write {run_dir}" in line and "No space left on device" in line, text
        assert "bytes free on its file system" in line, text
    shown = status(run_dir, check=False)
    table = shown.stdout + shown.stderr
    assert shown.returncode == 0 and "no error recorded" not in table, table
    assert table.count("No space left on device") == len(failed), table

    ballast.unlink()
    run_cli(*args)
    assert batch_bytes(tmp_path / "out") == batch_bytes(finished_run[0] / "out")
    assert not list(run_dir.glob("progress/*.reserve"))  # the room kept for the last word goes with the shard
