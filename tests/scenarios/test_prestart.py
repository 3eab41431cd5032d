"""Workers started while the launcher prepares (run/prestart.py), in real processes. On CUDA that is the default;
``HSEXTRACT_PRESTART=1`` runs the same mechanism on CPU: the early workers must write exactly what workers
started after the preparation write, bad data must still fail with its message and leave no process behind, and
a rerun of a finished job must let its early workers go."""

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from support.cli import e2e_run_args, run_cli
from support.procs import descendants

from hsextract.run.prestart import PRESTART_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EARLY = {PRESTART_ENV: "1"}


def _batch_files(out: Path) -> dict[str, Path]:
    return {str(p.relative_to(out)): p for p in sorted(out.rglob("*.safetensors"))}


def _leftovers(run_dir: Path) -> list[int]:
    """Processes (of this test process) still naming the run dir: early workers that were never let go."""
    found = []
    for pid in descendants(__import__("os").getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline:
            found.append(pid)
    return found


def test_early_workers_write_the_same_output_as_workers_started_after_preparing(
    finished_run, tiny_model, tmp_path
):
    ref_root, data, _, _ = finished_run
    r = run_cli(*e2e_run_args(tmp_path, tiny_model, data), env=EARLY)
    assert r.returncode == 0, r.stdout + r.stderr
    for shard in (0, 1):
        log = (tmp_path / "run" / "logs" / f"shard-0000{shard}.stderr.log").read_text()
        assert "started early: imports and CUDA in" in log, log
    ours, theirs = _batch_files(tmp_path / "out"), _batch_files(ref_root / "out")
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        a, b = load_file(ours[name]), load_file(theirs[name])
        assert a.keys() == b.keys()
        for key in a:
            assert (a[key] == b[key]).all(), (name, key)
    assert (tmp_path / "out" / "manifest.json").is_file()
    r = run_cli("verify", tmp_path / "out", check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not _leftovers(tmp_path / "run")


def test_bad_data_fails_with_its_message_and_the_early_workers_load_nothing_and_exit(tiny_model, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("{not json\n" + json.dumps({"messages": []}) + "\n")  # nothing usable: refused
    r = run_cli(*e2e_run_args(tmp_path, tiny_model, data), env=EARLY, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no usable samples" in r.stdout + r.stderr
    for shard in (0, 1):  # they were started, then let go
        go = json.loads((tmp_path / "run" / "prestart" / f"shard-0000{shard}.json").read_text())
        assert go == {"run": False}
    logs = tmp_path / "run" / "logs"
    for log in logs.glob("shard-*.log") if logs.exists() else []:
        assert "model loaded" not in log.read_text()
    assert not _leftovers(tmp_path / "run")


def test_a_rerun_of_a_finished_job_lets_its_early_workers_go(finished_run, tiny_model, tmp_path):
    ref_root, data, _, _ = finished_run
    r = run_cli(*e2e_run_args(tmp_path, tiny_model, data), env=EARLY)
    assert r.returncode == 0
    r = run_cli(*e2e_run_args(tmp_path, tiny_model, data), env=EARLY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "shards already complete: [0, 1]" in r.stdout
    for shard in (0, 1):
        go = json.loads((tmp_path / "run" / "prestart" / f"shard-0000{shard}.json").read_text())
        assert go == {"run": False}
    assert not _leftovers(tmp_path / "run")


def test_a_missing_model_is_refused_with_its_message_and_the_early_workers_exit(finished_run, tmp_path):
    _, data, _, _ = finished_run
    r = run_cli(*e2e_run_args(tmp_path, tmp_path / "no-such-model", data), env=EARLY, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no such directory" in r.stdout + r.stderr
    assert not _leftovers(tmp_path / "run")
