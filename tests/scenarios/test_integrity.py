"""Nothing silently wrong: runs isolated from each other, every batch checked before the manifest, clear refusals.

Each test reproduces one finding of the integrity review with real processes and real faults (files deleted or
swapped behind a run's back, a real full file system, concurrent launchers, damaged run files), on the tiny model.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import (
    TINY_LIMITS,
    cli_run_args,
    done_count,
    frozen_while_computing,
    launched,
    launcher_output,
    run_cli,
    wait_for,
    write_mixed_dataset,
)
from support.fs import mounted_tmpfs
from support.procs import freeze
from support.s3server import cli_env

from hsextract.config import run_staging_dir
from hsextract.output import Plan, open_output
from hsextract.output.records import JOB
from hsextract.run.progress import ShardProgress
from hsextract.validation import SEAL_KEY, seal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer):
    return write_mixed_dataset(
        tmp_path_factory.mktemp("integrity-data") / "data.jsonl", tiny_tokenizer, n_chat=30
    )


@pytest.fixture(scope="module")
def other_dataset(tmp_path_factory, tiny_tokenizer):
    return write_mixed_dataset(
        tmp_path_factory.mktemp("integrity-other") / "data.jsonl", tiny_tokenizer, n_chat=30, seed=1
    )


def args_for(root: Path, model, data, **options) -> list:
    opts = {
        **TINY_LIMITS,
        "max_tokens_per_batch": 300,
        "max_rows": 8,
        "layers": "0,3,7",
        "shards": 2,
        "num_proc": 1,
        "no_progress": True,
        **options,
    }
    return cli_run_args(root, model, data, **opts)


def refused(args, *needles) -> str:
    r = run_cli(*args, check=False)
    text = r.stdout + r.stderr
    assert r.returncode == 2, f"expected exit 2, got {r.returncode}\n{text}"
    assert "Traceback" not in text, text
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text}"
    return text


def batch_bytes(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.glob("shard-*/*.safetensors"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, dataset):
    """An uninterrupted run of the plan most tests use."""
    root = tmp_path_factory.mktemp("integrity-reference")
    run_cli(*args_for(root, tiny_model, dataset))
    return root


# -- 1. runs never share staged files ---------------------------------------------------------------------------
def test_runs_with_one_staging_root_stage_apart_and_a_foreign_staged_file_is_never_uploaded(
    tmp_path, tiny_model, dataset, other_dataset, reference
):
    """Run A (run dir a/job) left files in staging; run B (b/job, other data) shares the staging root. B stages
    in its own directory, and a file of A's placed under B's own batch name is discarded (its header names
    another plan), recomputed, and B's output is B's alone."""
    staging_root = tmp_path / "staging"
    a_dir, b_dir = tmp_path / "a" / "job", tmp_path / "b" / "job"
    assert run_staging_dir(staging_root, a_dir) != run_staging_dir(staging_root, b_dir)

    b_root = tmp_path / "b"
    b_args = args_for(b_root, tiny_model, other_dataset, run_dir=b_dir, staging=staging_root)
    b_ref = tmp_path / "b-ref"
    run_cli(*args_for(b_ref, tiny_model, other_dataset))
    b_plan = Plan.load(b_ref / "run" / "plan.json")

    # A's batch file, under the name of one of B's batches, in B's own staging directory.
    victim = b_plan.for_shard(0)[0]
    a_file = next(iter(sorted((reference / "out").glob("shard-00000/*.safetensors"))))
    b_staged = run_staging_dir(staging_root, b_dir) / "shard-00000" / Path(victim.key).name
    b_staged.parent.mkdir(parents=True)
    shutil.copyfile(a_file, b_staged)

    run_cli(*b_args)
    log = (b_dir / "logs" / "shard-00000.log").read_text()
    assert f"discarded staged file {Path(victim.key).name}: written for another plan" in log
    assert batch_bytes(b_root / "out") == batch_bytes(b_ref / "out")
    out = open_output(b_root / "out")
    assert sorted(out.sample_ids()) == sorted(open_output(b_ref / "out").sample_ids())


# -- 2. staging and output must live apart -----------------------------------------------------------------------
@pytest.mark.parametrize("where", ["same", "staging-inside-output", "output-is-the-run-staging-dir"])
def test_overlapping_staging_and_output_are_refused_before_any_work(tmp_path, tiny_model, dataset, where):
    place = tmp_path / "place"
    staging, output = {
        "same": (place, place),
        "staging-inside-output": (place / "staging", place),
        # --staging is a root: the run stages in a directory of its own under it, which must not be the output
        "output-is-the-run-staging-dir": (place, run_staging_dir(place, tmp_path / "run")),
    }[where]
    refused(args_for(tmp_path, tiny_model, dataset, staging=staging, output=output), "overlap", "--staging")
    assert not (tmp_path / "run" / "plan.json").exists()
    assert not output.exists() or not any(output.rglob("*.safetensors"))


# -- 3. one output, one job ----------------------------------------------------------------------------------------
def test_two_run_dirs_started_together_on_one_output_one_is_refused(tmp_path, tiny_model, dataset):
    out = tmp_path / "shared-out"
    runs = []
    for name, layers in (("r1", "0,3,7"), ("r2", "1,3,7")):
        root = tmp_path / name
        root.mkdir()
        args = args_for(root, tiny_model, dataset, output=out, layers=layers)
        cmd = [sys.executable, "-m", "hsextract.cli", *map(str, args)]
        runs.append(
            (root, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        )
    results = [(root, p.wait(timeout=240), p.stdout.read()) for root, p in runs]
    codes = sorted(code for _, code, _ in results)
    assert codes == [0, 2], results
    ((winner, _, _),) = [r for r in results if r[1] == 0]
    ((_, _, loser_text),) = [r for r in results if r[1] == 2]
    assert "is held by another job" in loser_text and str(winner / "run") in loser_text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan_hash"] == Plan.load(winner / "run" / "plan.json").plan_hash
    assert json.loads((out / JOB).read_text())["plan_hash"] == manifest["plan_hash"]


def test_uploader_stops_when_the_output_is_claimed_by_another_job_mid_run(tmp_path, tiny_model, dataset):
    args = args_for(tmp_path, tiny_model, dataset)
    run_dir = tmp_path / "run"
    with launched(args, tmp_path) as proc:
        wait_for(lambda: done_count(run_dir) >= 1, "a first durable batch", proc=proc, root=tmp_path)
        pids = frozen_while_computing(run_dir, proc, tmp_path)  # so uploads follow the change
        job = json.loads((tmp_path / "out" / JOB).read_text())
        job = {
            k: v for k, v in job.items() if k != SEAL_KEY
        }  # another job's claim proves itself, as ours does
        (tmp_path / "out" / JOB).write_text(json.dumps(seal({**job, "plan_hash": "0123456789abcdef"})))
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        assert proc.wait(timeout=120) == 1
    text = launcher_output(tmp_path)
    assert "is now held by another job" in text and "0123456789abcdef" in text
    assert not (tmp_path / "out" / "manifest.json").exists()


# -- 4. weights changed between a crash and the resume ------------------------------------------------------------
def test_changed_weights_with_the_same_config_are_refused_like_other_plan_changes(tmp_path, dataset):
    from hsextract.demo import build_model

    model = build_model(tmp_path / "model")
    args = args_for(tmp_path, model, dataset)
    run_cli(*args)
    weights = next(Path(model).glob("*.safetensors"))
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] + 0.01  # another checkpoint of the same architecture
    save_file(tensors, weights, metadata={"format": "pt"})
    refused(args, "holds a different plan", "model_weights_hash")


# -- 5. the manifest only over batches that are really there ------------------------------------------------------
def test_output_files_deleted_mid_run_are_recomputed_before_the_manifest(
    tmp_path, tiny_model, dataset, reference
):
    args = args_for(tmp_path, tiny_model, dataset)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    with launched(args, tmp_path) as proc:
        wait_for(lambda: done_count(run_dir, 0) >= 1, "a durable batch of shard 0", proc=proc, root=tmp_path)
        freeze(ShardProgress.load(run_dir, 0).pid)
        victims = sorted(out.glob("shard-00000/*.safetensors"))
        for v in victims:
            v.unlink()  # deleted behind the run's back, after it was recorded done
        os.kill(ShardProgress.load(run_dir, 0).pid, signal.SIGCONT)
        assert proc.wait(timeout=180) == 0, launcher_output(tmp_path)
    text = launcher_output(tmp_path)
    assert "missing or damaged" in text and "recomputing" in text
    assert batch_bytes(out) == batch_bytes(reference / "out")


def test_rerun_of_a_finished_run_replaces_missing_and_truncated_files(
    tmp_path, tiny_model, dataset, reference
):
    args = args_for(tmp_path, tiny_model, dataset)
    run_cli(*args)
    out = tmp_path / "out"
    files = sorted(out.glob("shard-*/*.safetensors"))
    files[0].unlink()
    files[-1].write_bytes(files[-1].read_bytes()[:100])
    (out / "manifest.json").unlink()
    r = run_cli(*args)
    assert "batch file missing" in r.stdout and "bytes" in r.stdout
    assert batch_bytes(out) == batch_bytes(reference / "out")
    assert (out / "manifest.json").exists()


# -- 8. credentials never written or printed ------------------------------------------------------------------------
def test_a_password_in_the_endpoint_url_is_never_written_or_printed(
    tmp_path, tiny_model, dataset, s3, s3_bucket
):
    secret = "S3cretPassw0rd"
    endpoint = s3.url.replace("http://", f"http://someone:{secret}@")
    args = args_for(tmp_path, tiny_model, dataset, output=f"s3://{s3_bucket}/pw", s3_endpoint_url=endpoint)
    ok = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=240,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "hsextract.cli",
            *_with(_with(args, "--output", "s3://no-such-bucket-pw/x"), "--run-dir", tmp_path / "run-x"),
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert bad.returncode == 2 and "http://***@127.0.0.1" in bad.stderr, bad.stderr
    status = run_cli("status", tmp_path / "run", "--json")
    seen = [ok.stdout, ok.stderr, bad.stdout, bad.stderr, status.stdout]
    seen += [
        p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size < 10**7
    ]
    client = s3.client()
    for key in s3.object_keys(s3_bucket):
        seen.append(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read().decode(errors="replace"))
    leaks = [text[:200] for text in seen if secret in text]
    assert not leaks, f"the password leaked: {leaks}"


def _with(args: list, flag: str, value) -> list:
    args = list(map(str, args))
    args[args.index(flag) + 1] = str(value)
    return args


# -- 9. a damaged plan.json ------------------------------------------------------------------------------------------
def test_truncated_plan_gives_a_clear_message_and_restart_recovers(tmp_path, tiny_model, dataset, reference):
    args = args_for(tmp_path, tiny_model, dataset)
    run_cli(*args)
    plan = tmp_path / "run" / "plan.json"
    plan.write_text(plan.read_text()[:50])
    r = run_cli("status", tmp_path / "run", check=False)
    assert (
        r.returncode == 2
        and "plan.json" in r.stderr
        and "damaged" in r.stderr
        and "Traceback" not in r.stderr
    )
    refused(args, "plan.json", "damaged", "--restart")
    run_cli(*args, "--restart", "--yes")  # the output was finished: --restart asks first
    assert batch_bytes(tmp_path / "out") == batch_bytes(reference / "out")


# -- 11. smaller ones ------------------------------------------------------------------------------------------------
def test_run_dir_that_is_a_file_is_refused(tmp_path, tiny_model, dataset):
    (tmp_path / "run").write_text("not a directory")
    refused(args_for(tmp_path, tiny_model, dataset), "--run-dir", "is a file")


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_non_finite_staging_budget_is_refused_before_the_model_loads(tmp_path, tiny_model, dataset, value):
    refused(args_for(tmp_path, tiny_model, dataset, staging_max_gb=value), "--staging-max-gb", "positive")
    assert not (tmp_path / "run" / "plan.json").exists()


def test_url_with_one_slash_is_refused_not_taken_for_a_directory(tmp_path, tiny_model, dataset):
    refused(args_for(tmp_path, tiny_model, dataset, output="s3:/bucket/x"), "missing slash", "s3://")
    assert not Path("s3:").exists()


def test_restart_while_another_launcher_runs_the_run_dir_is_refused(tmp_path, tiny_model, dataset, reference):
    args = args_for(tmp_path, tiny_model, dataset)
    with launched(args, tmp_path) as proc:
        wait_for(lambda: (tmp_path / "run" / "plan.json").exists(), "the plan", proc=proc, root=tmp_path)
        refused([*map(str, args), "--restart"], "in use by another hsextract run", "--restart")
        assert proc.wait(timeout=180) == 0, launcher_output(tmp_path)
    assert batch_bytes(tmp_path / "out") == batch_bytes(reference / "out")


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A real, separately mounted 4 MiB file system (tmpfs; needs root, as CI has)."""
    with mounted_tmpfs(tmp_path / "small-fs", "4m") as mount:
        yield mount


def test_full_staging_filesystem_names_the_path_and_a_rerun_completes(
    tmp_path, tiny_model, dataset, reference, tiny_filesystem
):
    args = args_for(tmp_path, tiny_model, dataset, staging=tiny_filesystem)
    run_dir = tmp_path / "run"
    with launched(args, tmp_path) as proc:
        # Frozen at the first durable batch instead, a loaded machine's shards had staged their whole share.
        pids = frozen_while_computing(run_dir, proc, tmp_path)
        ballast = tiny_filesystem / "ballast"
        with open(ballast, "wb") as f:  # fill the file system to the last byte
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        assert proc.wait(timeout=120) == 1
    text = launcher_output(tmp_path)
    assert "is full (no space left on device)" in text and str(tiny_filesystem) in text, text
    assert "Traceback" not in text
    ballast.unlink()
    run_cli(*args)
    assert batch_bytes(tmp_path / "out") == batch_bytes(reference / "out")
