"""Bad input gets one clear message (exit 2) before any weight loads, and loses nothing."""

import os
import time

import pytest
from support.cli import TINY_LIMITS, cli_run_args, run_cli, write_mixed_dataset


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
    t0 = time.time()
    r = run_cli(*args, check=False)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr
    return time.time() - t0


def test_layer_out_of_range(base):
    root, args = base
    _fails(args + ["--layers", "2,8"], "out of range", "ids 0..7")


def test_missing_model_path(base, tmp_path):
    _, args = base
    _fails(_replace(args, "--model", tmp_path / "no-model"), "no such directory")


def test_missing_data_path(base, tmp_path):
    _, args = base
    _fails(_replace(args, "--data", tmp_path / "nope.jsonl"), "nope.jsonl")


def test_all_rows_bad(base, tmp_path):
    _, args = base
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n{"foo": 1}\n')
    _fails(_replace(args, "--data", bad), "no usable")


def test_max_length_over_batch_budget(base):
    _, args = base
    _fails(_replace(args, "--max-length", "5000"), "--max-length 5000 exceeds --max-tokens-per-batch")


def test_full_staging_is_refused_before_the_model_loads(base):
    root, args = base
    # A batch budget no filesystem here can hold stands in for a full /dev/shm.
    args = _replace(_replace(args, "--max-tokens-per-batch", str(10**13)), "--max-length", "300")
    _fails(args, "GB free but one batch file needs", "--staging")
    assert not (root / "run" / "plan.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_staging(base, tmp_path):
    _, args = base
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    _fails(_replace(args, "--staging", ro / "x"), "not writable")


def test_bad_kernel_cache_and_load_threads_fail_before_tokenizing(base, tmp_path):
    root, args = base
    (tmp_path / "file").write_text("x")
    cuda = _replace(args, "--device", "cuda")
    blocked = cuda + ["--kernel-cache", tmp_path / "file" / "k"]
    _fails(blocked, "kernel cache", "cannot be created", "--kernel-cache")
    r = run_cli(*cuda, check=False, env={"HSEXTRACT_LOAD_THREADS": "lots"})
    assert r.returncode == 2 and "HSEXTRACT_LOAD_THREADS='lots'" in r.stderr, r.stderr
    assert not (root / "run" / "plan.json").exists()


def test_missing_options_are_named(tmp_path):
    r = run_cli("run", "--device", "cpu", check=False)
    assert r.returncode == 2 and "--model" in r.stderr and "--data" in r.stderr


def test_random_weights_are_refused_by_run(base, tmp_path):
    _, args = base
    cfg = tmp_path / "bench.yaml"
    cfg.write_text("random_weights: true\n")
    _fails(args + ["--config", cfg], "benchmarks only")


def test_unknown_yaml_option_is_named(base, tmp_path):
    _, args = base
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("max_token_per_batch: 4096\n")
    _fails(args + ["--config", cfg], "unknown option 'max_token_per_batch'")


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

    from hsextract.reader import open_output

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
