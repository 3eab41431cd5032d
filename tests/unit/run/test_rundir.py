"""A run refused by its checks leaves nothing behind: no run dir (the data files' hash memos do not count), no
staging directory; a command refused for its options names no run dir. `hsextract run` in this process."""

import os

import pytest
from click.testing import CliRunner

from hsextract.cli import main

pytestmark = pytest.mark.usefixtures("restored_process_state")


def test_a_run_refused_at_the_data_step_leaves_no_run_dir_and_no_staging(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"foo": 1}\nnot json\n')
    args = ["run", "--model", tiny_model, "--data", "bad.jsonl", "--output", "out", "--device", "cpu"]
    result = CliRunner().invoke(
        main, [*map(str, args), "--staging", str(tmp_path / "stage"), "--no-progress"]
    )
    assert result.exit_code == 2 and "no usable samples in bad.jsonl" in result.stderr, result.output
    assert "run dir: " in result.stdout  # the default run dir was said, and then removed
    assert not (tmp_path / "runs").exists(), sorted(map(str, (tmp_path / "runs").rglob("*")))
    assert os.listdir(tmp_path / "stage") == []  # the run's own staging directory went again


def test_a_command_refused_for_a_missing_option_names_no_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["run", "--data", "d.jsonl", "--output", "out", "--device", "cpu"])
    assert result.exit_code == 2 and "missing --model" in result.stderr, result.output
    assert "run dir" not in result.output and not (tmp_path / "runs").exists()
