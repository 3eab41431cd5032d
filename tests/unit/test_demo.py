"""The demo's job as a command (demo.run_command, demo.job_lines): what `hsextract demo` prints parses, through the
CLI's own options, to exactly the config the demo runs, and so does `--config RUN_DIR/config.json`. The demo itself
(real workers) prints it in tests/scenarios/test_docs.py, which reruns the printed `--config` command."""

import dataclasses
import shlex

from hsextract import cli
from hsextract.demo import demo_config, job_lines, run_command


def _parsed(argv: list[str]):
    """The RunConfig `hsextract run ARGV` builds, parsed by the command's own click options."""
    ctx = cli.run.make_context("run", argv)
    params = {
        k: v for k, v in ctx.params.items() if k not in ("only_shards", "restart", "yes", "no_progress")
    }
    return cli._build_config(**params)


def test_the_demo_command_and_its_config_file_give_exactly_the_demo_config(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "demo"
    cfg = demo_config(root, tiny_model, root / "conversations.jsonl", shards=2)
    command = run_command(cfg)
    argv = shlex.split(command)
    assert argv[:2] == ["hsextract", "run"]
    for shown in ("--dtype float32", "--final-state", "--max-length 1024", f"--staging {root}/staging"):
        assert shown in command, command
    resolved = cfg.with_model_resolved()
    assert _parsed(argv[2:]) == resolved
    cfg.save(root / "run" / "config.json")
    assert _parsed(["--config", "demo/run/config.json"]) == resolved
    lines = job_lines(cfg).splitlines()
    assert lines == [
        f"running: {command}",
        "(`hsextract run --config demo/run/config.json` repeats it: the run dir keeps its options in config.json)",
    ]
    assert "--layers" not in command  # a default is not repeated
    assert dataclasses.replace(cfg, layers="eagle3") != cfg and "--layers eagle3" in run_command(
        dataclasses.replace(cfg, layers="eagle3")
    )
