"""Workers started while the launcher prepares (startup/early.py), in real processes. On CUDA that is the default;
``HSEXTRACT_PRESTART=1`` runs the same mechanism on CPU: the early workers must write exactly what workers
started after the preparation write, bad data must still fail with its message and leave no process behind, and
a rerun of a finished job must let its early workers go."""

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open
from support.cli import e2e_run_args, run_cli, write_mixed_dataset
from support.procs import descendants

from hsextract.startup.early import PRESTART_ENV
from hsextract.startup.fastload import FAST_LOAD_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EARLY = {PRESTART_ENV: "1"}
STARTUP_OFF = {PRESTART_ENV: "0", FAST_LOAD_ENV: "0"}


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


def _tensors_and_metadata(path: Path) -> tuple[dict, dict]:
    """A batch file's tensors (dtype, shape and bytes) and its header's metadata."""
    with safe_open(path, "numpy") as f:
        meta = f.metadata()
        tensors = {k: (str(t.dtype), t.shape, t.tobytes()) for k in f.keys() for t in [f.get_tensor(k)]}
    return tensors, meta


def _without_times(value):
    """A manifest with its timestamps dropped: the one content two runs of the same job may differ in."""
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if not TIMESTAMP.search(k)}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


TIMESTAMP = re.compile(r"(^|_)(at|time|created|started|finished|seconds)$")


def test_output_is_byte_identical_with_start_up_disabled_and_enabled(tiny_model, tiny_tokenizer, tmp_path):
    """The start-up seam only makes the first batch come sooner: with it off (no early workers, no fast load) and
    on, the batch files hold the same tensors and metadata, and the manifests the same content."""
    data = write_mixed_dataset(tmp_path / "data.jsonl", tiny_tokenizer)
    outs = {}
    for name, env in (("off", STARTUP_OFF), ("on", EARLY)):
        root = tmp_path / name
        r = run_cli(*e2e_run_args(root, tiny_model, data), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        early = (root / "run" / "logs" / "shard-00000.stderr.log").read_text()
        assert ("started early: imports and CUDA in" in early) == (name == "on"), early
        outs[name] = root / "out"
    off, on = _batch_files(outs["off"]), _batch_files(outs["on"])
    assert off.keys() == on.keys() and off
    for name in off:
        assert _tensors_and_metadata(off[name]) == _tensors_and_metadata(on[name]), name
    manifests = [json.loads((outs[n] / "manifest.json").read_text()) for n in ("off", "on")]
    assert _without_times(manifests[0]) == _without_times(manifests[1])
    for out in outs.values():
        r = run_cli("verify", out, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
    assert not _leftovers(tmp_path / "on" / "run")


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
