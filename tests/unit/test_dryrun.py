"""``hsextract dry-run`` says each stage after the model's files are read (the weights, the proof, the timing of a
batch: minutes on a real model on a few cores), on stderr, so that ``--json`` stays one JSON document. The proofs
themselves: tests/scenarios/test_dryrun.py."""

import json

import pytest
from click.testing import CliRunner
from support.cli import write_mixed_dataset

from hsextract.cli import main

pytestmark = pytest.mark.usefixtures("restored_process_state")


def test_dry_run_says_each_long_stage_on_stderr_and_json_stays_clean(tiny_model, tiny_tokenizer, tmp_path):
    data = write_mixed_dataset(tmp_path / "data.jsonl", tiny_tokenizer, n_chat=2)
    args = ["dry-run", "--model", tiny_model, "--data", data, "--device", "cpu", "--dtype", "float32"]
    args += ["--layers", "0,3,7", "--num-samples", "2", "--max-length", "32", "--max-tokens-per-batch", "64"]
    result = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert result.exit_code in (0, 1), result.output
    assert json.loads(result.stdout)["layers"]  # nothing but the report on stdout
    stages = [line for line in result.stderr.splitlines() if line.startswith("dry-run: ")]
    assert [s.split(" ")[1] for s in stages if not s.startswith("dry-run: plain")] == [
        "tokenizing",
        "loading",
        "proving",
        "timing",
    ], result.stderr
    assert "dry-run: plain forwards" in result.stderr  # the per-sample bar of the proof


def test_dry_run_tokenizes_with_the_tokenizer_given_and_reports_it(tiny_model, tiny_tokenizer, tmp_path):
    from hsextract.demo import build_tokenizer, make_conversations, write_jsonl
    from hsextract.dryrun_report import format_report

    other = build_tokenizer(tmp_path / "tok", corpus=make_conversations(40, seed=7), vocab_size=400)
    row = make_conversations(1, seed=3)[0]
    data = write_jsonl([row], tmp_path / "rows.jsonl")
    args = [
        "dry-run",
        "--model",
        tiny_model,
        "--tokenizer",
        tmp_path / "tok",
        "--data",
        data,
        "--layers",
        "0",
    ]
    args += ["--device", "cpu", "--dtype", "float32", "--num-samples", "1"]
    result = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.stdout)
    assert report["tokenizer"] == report["tokenizer_dir"] == str(tmp_path / "tok")
    ids = [tok.apply_chat_template(row["messages"], return_dict=False) for tok in (other, tiny_tokenizer)]
    assert len(ids[0]) != len(ids[1]) and report["proof"]["tokens"] == len(ids[0])  # the given one's tokens
    assert f"tokenizer: --tokenizer {tmp_path / 'tok'}, files {tmp_path / 'tok'}; chat template" in (
        format_report(report)
    )
