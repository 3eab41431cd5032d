"""Defaults that need no reading: the run dir derived from the output, the tokenizer process count chosen from the
cores and the data's size, and a shard killed by a signal reported by its signal and log, not a stray output line.
(The run in test_serve.py uses the first two.)"""

import pytest

from hsextract.prepare.sources import AUTO_PARALLEL_MIN_BYTES, auto_num_proc
from hsextract.run.launcher import failure_message
from hsextract.run.rundir import default_run_dir


def test_default_run_dir_is_stable_per_output_and_distinct_across_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = default_run_dir("out")
    assert (
        first == default_run_dir("out") == default_run_dir(str(tmp_path / "out")) == default_run_dir("./out/")
    )
    assert first.parent == tmp_path / "runs" and first.name.startswith("out-")
    assert default_run_dir("other/out") != first  # same name, another directory
    s3 = default_run_dir("s3://my-bucket/qwen36 dflash/")
    assert s3.name.startswith("my-bucket-qwen36-dflash-") and s3 == default_run_dir(
        "s3://my-bucket/qwen36 dflash"
    )
    assert s3 != default_run_dir("s3://other-bucket/qwen36 dflash")
    # nodes of one job may share a current directory, never a run dir
    assert default_run_dir("s3://b/p", node_rank=3).name == default_run_dir("s3://b/p").name + "-node3"


def _sized(path, size):
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the size is what counts
    return path


@pytest.mark.parametrize(
    ("size", "cores", "expected"),
    [
        (1_000, 64, 1),  # the README's tiny file: a pool costs ~6 s more than the whole job
        (AUTO_PARALLEL_MIN_BYTES - 1, 64, 1),
        (AUTO_PARALLEL_MIN_BYTES, 2, 1),  # on 2 cores a pool never paid off
        (AUTO_PARALLEL_MIN_BYTES, 8, 8),
        (10 * AUTO_PARALLEL_MIN_BYTES, 128, 16),
    ],
)
def test_num_proc_is_chosen_from_cores_and_data_size(tmp_path, size, cores, expected):
    assert auto_num_proc(_sized(tmp_path / "data.jsonl", size), cores=cores) == expected


def test_num_proc_counts_parquet_as_its_text(tmp_path):
    parquet = _sized(tmp_path / "data.parquet", AUTO_PARALLEL_MIN_BYTES // 2)
    assert auto_num_proc(parquet, cores=16) == 16


def test_shard_killed_by_a_signal_names_the_signal_and_log_not_its_last_output_line(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "shard-00001.stderr.log").write_text(
        "  warnings.warn('resource_tracker: There appear to be 1 leaked semaphore objects')\n"
    )
    message = failure_message(tmp_path, 1, -9)
    assert message.splitlines()[0] == "shard 1 failed (killed by SIGKILL, out of host memory?)"
    assert f"log: {logs / 'shard-00001.log'}" in message
    assert "warn" not in message
    # an exit code of its own: the last output line is the best account there is
    assert "warnings.warn" in failure_message(tmp_path, 1, 1).splitlines()[0]


def test_num_proc_counts_every_file_of_a_dataset_directory(tmp_path):
    (tmp_path / "ds").mkdir()
    _sized(tmp_path / "ds" / "data-00000-of-00002.arrow", AUTO_PARALLEL_MIN_BYTES // 2)
    _sized(tmp_path / "ds" / "data-00001-of-00002.arrow", AUTO_PARALLEL_MIN_BYTES // 2)
    assert auto_num_proc(tmp_path / "ds", cores=8) == 8
