"""The CLI is built from RunConfig: every option a job had keeps its name, help comes from the field's docstring,
defaults live in RunConfig alone, and a YAML file fills what the command line leaves out."""

import dataclasses

import pytest
from click.testing import CliRunner

from hsextract.cli import _build_config, main
from hsextract.config import RunConfig, field_docs
from hsextract.errors import HsextractError

# The job options `run` and `dry-run` had before the CLI was generated from RunConfig.
JOB_OPTIONS = [
    "--config", "--model", "--data", "--layers", "--max-length", "--too-long", "--max-tokens-per-batch",
    "--max-rows", "--device", "--dtype", "--attn-implementation", "--kernels", "--final-state", "--no-final-state",
    "--storage-dtype", "--num-proc",
]  # fmt: skip
RUN_OPTIONS = [
    "--output", "--run-dir", "--shards", "--gpus", "--staging", "--staging-max-gb", "--s3-endpoint-url", "--nodes",
    "--node-rank", "--stall-timeout", "--only-shards", "--restart", "--no-progress",
]  # fmt: skip


def _options(command: str) -> set[str]:
    cmd = main.commands[command]
    return {name for p in cmd.params for name in (*p.opts, *p.secondary_opts)}


def test_run_and_dry_run_keep_every_option_name():
    assert set(JOB_OPTIONS + RUN_OPTIONS) <= _options("run")
    assert set(JOB_OPTIONS) | {"--num-samples", "--shards", "--run-dir", "--json"} <= _options("dry-run")
    assert "--output" not in _options("dry-run")


def test_every_cli_field_has_help_from_its_docstring_and_no_default_of_its_own():
    docs = field_docs()
    cmd = main.commands["run"]
    by_name = {p.name: p for p in cmd.params}
    for f in dataclasses.fields(RunConfig):
        if f.metadata.get("cli") is None:
            continue
        assert f.name in docs, f"RunConfig.{f.name} has no docstring"
        param = by_name[f.name]
        assert param.default is None, f"--{f.name} has a default of its own; RunConfig's is the one"
        first_words = " ".join(docs[f.name].replace("``", "").split()[:4])
        assert first_words in " ".join(param.help.split()), f.name


def test_help_names_the_dataclass_defaults():
    out = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    assert "[default: 65536]" in out and "[default: dflash]" in out and "[default: 180.0]" in out


def test_yaml_fills_and_the_command_line_overrides(tmp_path):
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("model: /m\ndata: d.jsonl\nmax-length: 100\nlayers: [1, 2]\ngpus: [0, 1]\n")
    cfg = _build_config(config_file=str(yaml_file), output=str(tmp_path / "o"), max_length=None, shards=2)
    assert (cfg.max_length, cfg.layers, cfg.gpus, cfg.shards) == (100, (1, 2), (0, 1), 2)
    assert cfg.max_tokens_per_batch == RunConfig.__dataclass_fields__["max_tokens_per_batch"].default
    cfg = _build_config(config_file=str(yaml_file), output=str(tmp_path / "o"), max_length=50)
    assert cfg.max_length == 50


def test_missing_model_is_a_message_not_a_traceback(tmp_path):
    with pytest.raises(HsextractError, match="missing --model"):
        _build_config(data="d.jsonl", output=str(tmp_path / "o"))


def test_gpus_take_a_comma_list_on_the_command_line(tmp_path):
    result = CliRunner().invoke(
        main, ["run", "--gpus", "0,x", "--model", "m", "--data", "d", "--output", "o"]
    )
    assert result.exit_code == 2 and "comma-separated list of integers" in result.output


def test_run_without_options_names_what_is_missing_and_not_the_defaulted_run_dir():
    result = CliRunner().invoke(main, ["run"])
    assert result.exit_code == 2
    assert "missing --model, --data, --output" in result.output and "--run-dir" not in result.output


def test_help_marks_required_options_states_the_run_dir_default_and_cites_no_source_file():
    import re

    for command in ("run", "dry-run"):
        out = CliRunner().invoke(main, [command, "--help"], terminal_width=200).output
        for option in ("--model", "--data") + (("--output",) if command == "run" else ()):
            line = next(line for line in out.splitlines() if line.strip().startswith(option))
            assert "[required" in out[out.index(line) :].split("\n  --")[0], (option, line)
        cited = re.findall(r"\b[\w/]+\.py\b|\(\w+\.\w+_\w+\)", out)
        assert not cited, f"{command} --help cites source: {cited}"
    run_help = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    assert "runs/<output name>-<hash of the output>" in " ".join(run_help.split())


def test_export_num_proc_defaults_from_the_cores_this_process_may_use():
    import os

    from hsextract.export.runner import default_num_proc

    assert default_num_proc() == min(8, len(os.sched_getaffinity(0)))
    out = CliRunner().invoke(main, ["export", "--help"], terminal_width=200).output
    assert "the cores this process may use" in " ".join(out.split())
    assert "[default: 4]" not in out
