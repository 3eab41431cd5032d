"""The CLI is built from RunConfig: every option a job had keeps its name, help comes from the field's docstring,
defaults live in RunConfig alone, and a YAML file fills what the command line leaves out."""

import dataclasses
import os

import pytest
from click.testing import CliRunner
from support.cli import TINY_LIMITS, cli_run_args, write_mixed_dataset

from hsextract.cli import _build_config, main
from hsextract.config import RunConfig, field_docs
from hsextract.errors import HsextractError

# The job options `run` and `dry-run` had before the CLI was generated from RunConfig.
JOB_OPTIONS = [
    "--config", "--model", "--data", "--layers", "--max-length", "--too-long", "--max-tokens-per-batch",
    "--max-rows", "--device", "--dtype", "--attn-implementation", "--kernels", "--final-state", "--no-final-state",
    "--storage-dtype", "--num-proc", "--target-topk",
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


# -- bad input: one message, exit 2, before any weight loads (the command in this process; one real process:
# -- tests/scenarios/test_cli_errors.py) ----------------------------------------------------------------------------
@pytest.fixture
def cli(restored_process_state):
    """``hsextract ARGS`` in this process: (exit code, stderr); what ``run`` installs in its process is put back
    after (``restored_process_state``)."""

    def invoke(*args, env=None):
        result = CliRunner().invoke(main, [str(a) for a in args], env=env)
        if not isinstance(result.exception, SystemExit | None):
            raise result.exception  # a traceback where a message was due
        return result.exit_code, result.stderr

    return invoke


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model, tiny_tokenizer):
    """A valid ``run`` command under a fresh root: (root, args). Each test breaks one thing."""
    root = tmp_path_factory.mktemp("cli")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer, n_chat=5)
    return root, cli_run_args(root, tiny_model, data, num_proc=1, no_progress=True, **TINY_LIMITS)


def _replace(args, flag, value):
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _refused(cli, args, *needles, env=None):
    code, err = cli(*args, env=env)
    assert code == 2, (code, err)
    for needle in needles:
        assert needle in err, err


def test_a_layer_out_of_range_is_refused(cli, job):
    _refused(cli, job[1] + ["--layers", "2,8"], "out of range", "ids 0..7")


def test_a_missing_model_or_data_path_is_named(cli, job, tmp_path):
    _refused(cli, _replace(job[1], "--model", tmp_path / "no-model"), "no such directory")
    _refused(cli, _replace(job[1], "--data", tmp_path / "nope.jsonl"), "nope.jsonl")


def test_data_without_one_usable_row_is_refused(cli, job, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n{"foo": 1}\n')
    _refused(cli, _replace(job[1], "--data", bad), "no usable")


def test_max_length_over_the_batch_budget_is_refused(cli, job):
    _refused(
        cli, _replace(job[1], "--max-length", "5000"), "--max-length 5000 exceeds --max-tokens-per-batch"
    )


def test_full_staging_is_refused_before_the_model_loads(cli, job):
    root, args = job
    # A batch budget no filesystem here can hold stands in for a full /dev/shm.
    args = _replace(_replace(args, "--max-tokens-per-batch", str(10**13)), "--max-length", "300")
    _refused(cli, args, "GB free but one batch file needs", "--staging")
    assert not (root / "run" / "plan.json").exists()


def test_a_staging_bound_under_one_batch_file_is_refused_naming_the_size_needed(cli, job):
    _refused(
        cli, job[1] + ["--staging-max-gb", "0.000001"], "--staging-max-gb 1e-06 is smaller than one batch"
    )
    assert not (job[0] / "run" / "plan.json").exists()


def test_run_says_before_the_capture_which_trainer_formats_its_layers_serve(
    job, tmp_path, restored_process_state
):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')  # refused after the model checks, before anything is written
    args = [str(a) for a in _replace(job[1], "--data", bad)] + ["--max-bad-rows", "0"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "serves: specforge-dflash, specforge-dflash2" in result.stdout, result.stdout
    line = next(x for x in result.stdout.splitlines() if x.startswith("does not serve specforge-dspark"))
    assert "speculators, modelopt" in line and "--final-state" in line
    final = CliRunner().invoke(main, args + ["--final-state"])
    assert "does not serve specforge-dspark" not in final.stdout and "speculators" in final.stdout


def test_dtype_takes_bf16_and_auto_as_transformers_and_vllm_do(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    base = dict(model=str(model), data="d.jsonl", output="o", run_dir=str(tmp_path / "r"), device="cpu")
    assert RunConfig(**base, dtype="bf16").dtype == "bfloat16"
    assert RunConfig(**base, dtype="auto").dtype == "bfloat16"  # no config.json: bfloat16
    (model / "config.json").write_text('{"text_config": {"torch_dtype": "float16"}}')
    assert RunConfig(**base, dtype="auto").dtype == "float16"
    (model / "config.json").write_text('{"dtype": "float32"}')
    assert RunConfig(**base, dtype="auto").dtype == "float32"
    with pytest.raises(HsextractError, match="bf16 or auto"):
        RunConfig(**base, dtype="int8")
    out = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    assert "bf16" in out and "auto" in out


def test_a_template_name_for_chat_template_says_it_takes_a_file(tmp_path):
    with pytest.raises(HsextractError, match="qwen: no such file.*not a template name.*leave it out"):
        RunConfig(model="m", data="d", output="o", run_dir=str(tmp_path), device="cpu", chat_template="qwen")


def test_tensor_parallel_size_says_shards_are_data_parallel_and_where_tp_stands():
    result = CliRunner().invoke(main, ["run", "--tensor-parallel-size", "8", "--model", "m", "--data", "d"])
    assert result.exit_code == 2 and "--shards N is data parallel" in result.output, result.output
    assert "docs/SCALING.md" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["dry-run", "--tp", "2", "--model", "m", "--data", "d"])
    assert result.exit_code == 2 and "no tensor parallelism" in result.output, result.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_staging_is_refused(cli, job, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    _refused(cli, _replace(job[1], "--staging", ro / "x"), "not writable")


def test_a_bad_kernel_cache_or_load_thread_count_fails_before_tokenizing(cli, job, tmp_path):
    root, args = job
    (tmp_path / "file").write_text("x")
    cuda = _replace(args, "--device", "cuda")
    blocked = cuda + ["--kernel-cache", tmp_path / "file" / "k"]
    _refused(cli, blocked, "kernel cache", "cannot be created", "--kernel-cache")
    _refused(cli, cuda, "HSEXTRACT_LOAD_THREADS='lots'", env={"HSEXTRACT_LOAD_THREADS": "lots"})
    assert not (root / "run" / "plan.json").exists()


def test_missing_options_are_named(cli):
    code, err = cli("run", "--device", "cpu")
    assert code == 2 and "--model" in err and "--data" in err, err


def test_random_weights_are_refused_by_run(cli, job, tmp_path):
    cfg = tmp_path / "bench.yaml"
    cfg.write_text("random_weights: true\n")
    _refused(cli, job[1] + ["--config", cfg], "benchmarks only")


def test_an_unknown_yaml_option_is_named(cli, job, tmp_path):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("max_token_per_batch: 4096\n")
    _refused(cli, job[1] + ["--config", cfg], "unknown option 'max_token_per_batch'")


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
