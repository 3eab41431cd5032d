"""Bad input gets one clear message (exit 2) before any weight loads, and loses nothing: here in a real process
(the CLI's own exit and stderr) and against real runs' outputs; the other refusals run in-process in
tests/unit/test_cli.py."""

import pytest
from support.cli import TINY_LIMITS, cli_run_args, run_cli, write_mixed_dataset

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model, tiny_tokenizer):
    root = tmp_path_factory.mktemp("cli")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer, n_chat=5)
    args = cli_run_args(root, tiny_model, data, num_proc=1, no_progress=True, **TINY_LIMITS)
    return root, args


def _replace(args, flag, value):
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _fails(args, *needles):
    r = run_cli(*args, check=False)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


def test_a_refusal_in_a_real_process_exits_2_with_its_message_and_no_traceback(base):
    root, args = base
    _fails(args + ["--layers", "2,8"], "out of range", "ids 0..7")


def test_new_run_dir_into_an_output_of_another_run_is_refused(base, tmp_path):
    root, args = base
    args = _replace(_replace(args, "--output", tmp_path / "out"), "--run-dir", tmp_path / "run1")
    run_cli(*args, "--layers", "1,2")
    before = sorted(p.name for p in (tmp_path / "out").rglob("*"))
    other = _replace(args, "--run-dir", tmp_path / "run2")
    # The output's claim names the job that holds it, and what differs.
    _fails(other + ["--layers", "1,3"], "is held by another job", str(tmp_path / "run1"), "layer_ids")
    # An output written before claims existed (no job.json): its manifest, else its batch files, refuse it.
    (tmp_path / "out" / "hsextract" / "job.json").unlink()
    _fails(other + ["--layers", "1,3"], "already holds a finished run with another plan")
    (tmp_path / "out" / "manifest.json").unlink()
    _fails(other + ["--layers", "1,3"], "already holds", "batch file(s)", "--run-dir")
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == [
        n for n in before if n not in ("manifest.json", "job.json")
    ]


def test_repeated_row_ids_are_kept_and_renamed(tmp_path, tiny_model):
    import json

    from hsextract.output import open_output

    data = tmp_path / "dup.jsonl"
    rows = [
        {"id": "a", "input_ids": [5, 6, 7]},
        {"id": "a", "input_ids": [8, 9]},
        {"id": "b", "input_ids": [3]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_cli(
        *cli_run_args(
            tmp_path, tiny_model, data, num_proc=1, no_progress=True, max_length=64, max_tokens_per_batch=64
        )
    )
    assert "1 row(s) repeat an earlier row's id" in r.stdout
    out = open_output(tmp_path / "out")
    assert sorted(out.sample_ids()) == ["a", "a#2", "b"]
    assert out["a#2"]["input_ids"].tolist() == [8, 9]
    assert json.loads((tmp_path / "run" / "data_report.json").read_text())["duplicate_ids_renamed"] == 1
