"""The output, not the run dir, decides what is done; no process prints a credential; bad states stop the run.

Each test reproduces one finding of the reliability review with real processes and real damage (files deleted or
altered in the output behind the run, the output deleted, an unreachable endpoint with a password in its URL, a
model whose states overflow), on the tiny model. Tests that start from a finished run copy one module-scoped run
(``copy_finished_run``) instead of running their own.
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
    copy_finished_run,
    done_count,
    frozen_while_computing,
    launched,
    launcher_output,
    run_cli,
    status_json,
    wait_for,
    write_mixed_dataset,
)
from support.damage import flip
from support.fs import mounted_tmpfs
from support.s3server import S3Endpoint, cli_env, free_port

from hsextract.config import run_staging_dir
from hsextract.output import Plan
from hsextract.output.manifest import MANIFEST
from hsextract.output.records import done_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer):
    return write_mixed_dataset(
        tmp_path_factory.mktemp("reliability-data") / "data.jsonl", tiny_tokenizer, n_chat=20
    )


def args_for(root: Path, model, data, **options) -> list:
    opts = {
        **TINY_LIMITS,
        "max_tokens_per_batch": 400,
        "max_rows": 8,
        "layers": "0,3,7",
        "shards": 1,  # no test here is about shards; each worker start is ~7 CPU-s
        "num_proc": 1,
        "no_progress": True,
        **options,
    }
    return cli_run_args(root, model, data, **opts)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, dataset):
    """A finished run: ``out`` and ``run`` under the returned root."""
    root = tmp_path_factory.mktemp("reliability-reference")
    run_cli(*args_for(root, tiny_model, dataset))
    return root


def batch_bytes(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.glob("shard-*/*.safetensors"))}


def assert_verified(out: Path) -> None:
    r = run_cli("verify", out, check=False)
    assert r.returncode == 0 and "all good" in r.stdout, r.stdout + r.stderr


# -- 1. the output decides what is done --------------------------------------------------------------------------
def test_a_run_dir_is_bound_to_its_output_another_output_is_refused_naming_both(
    tmp_path, tiny_model, dataset, reference
):
    """The same command with another --output and the old run dir used to exit 0 ("shards already complete",
    no manifest) on every rerun, leaving the new output empty."""
    copy_finished_run(reference, tmp_path)
    other = tmp_path / "B"
    r = run_cli(*args_for(tmp_path, tiny_model, dataset, output=other), check=False)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert "Traceback" not in text
    assert f"belongs to the job writing --output {tmp_path / 'out'}, not {other}" in text
    assert "another --run-dir" in text
    assert not other.exists() or not any(other.rglob("*.safetensors"))
    # Without --run-dir the new output gets its own run dir and completes.
    ok = run_cli(*args_for(tmp_path, tiny_model, dataset, output=other, run_dir=None), cwd=tmp_path)
    assert "done:" in ok.stdout, ok.stdout
    assert batch_bytes(other) == batch_bytes(reference / "out")


def test_a_batch_whose_record_and_file_are_deleted_from_the_output_is_recomputed(
    tmp_path, tiny_model, dataset, reference
):
    """The output lacked a batch, record and file, that an earlier run had finished: it is computed again."""
    copy_finished_run(reference, tmp_path)
    out = tmp_path / "out"
    (out / MANIFEST).unlink()
    victim = sorted(out.glob("shard-00000/*.safetensors"))[1].relative_to(out).as_posix()
    (out / victim).unlink()
    (out / done_key(victim)).unlink()
    r = run_cli(*args_for(tmp_path, tiny_model, dataset))
    assert "done:" in r.stdout and (out / MANIFEST).is_file(), r.stdout
    log = (tmp_path / "run" / "logs" / "shard-00000.log").read_text()
    assert "resume: " in log and "1 to compute" in log
    assert batch_bytes(out) == batch_bytes(reference / "out")
    assert_verified(out)


def test_an_output_deleted_behind_the_run_is_recomputed_even_with_restart(
    tmp_path, tiny_model, dataset, reference
):
    copy_finished_run(reference, tmp_path)
    shutil.rmtree(tmp_path / "out")
    r = run_cli(*args_for(tmp_path, tiny_model, dataset), "--restart")
    assert "done:" in r.stdout, r.stdout
    assert batch_bytes(tmp_path / "out") == batch_bytes(reference / "out")
    assert_verified(tmp_path / "out")


def test_a_rerun_of_a_finished_run_replaces_an_edited_manifest_and_exit_0_means_verify_is_clean(
    tmp_path, tiny_model, dataset, reference
):
    copy_finished_run(reference, tmp_path)
    manifest = tmp_path / "out" / MANIFEST
    edited = json.loads(manifest.read_text())
    edited["layer_ids"] = edited["fingerprint"]["layer_ids"] = [0, 3, 6]
    manifest.write_text(json.dumps(edited))
    assert run_cli("verify", tmp_path / "out", check=False).returncode != 0
    r = run_cli(*args_for(tmp_path, tiny_model, dataset))
    assert "shards already complete: [0]" in r.stdout and "done:" in r.stdout, r.stdout
    assert json.loads(manifest.read_text()) == json.loads((reference / "out" / MANIFEST).read_text())
    assert_verified(tmp_path / "out")


def test_an_edited_job_file_is_refused_by_name_and_no_sound_batch_record_or_manifest_is_deleted(
    tmp_path, tiny_model, dataset, reference
):
    """Two samples swapped in the output's plan.json: the run and finalize blamed the batch files, deleted every
    completion record and the manifest of a sound output, recomputed, and exited 1 on every rerun."""
    copy_finished_run(reference, tmp_path)
    out = tmp_path / "out"
    plan_file = out / "hsextract" / "plan.json"
    plan = json.loads(plan_file.read_text())
    a, b = plan["batches"][0][4], plan["batches"][1][4]
    a[0], b[0] = b[0], a[0]
    plan_file.write_text(json.dumps(plan))
    sound = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p != plan_file}
    for command in (args_for(tmp_path, tiny_model, dataset), ("finalize", out), ("verify", out)):
        r = run_cli(*command, check=False)
        said = (r.stdout + r.stderr).strip()
        assert r.returncode == 2 and "hsextract/plan.json" in said and "Traceback" not in said, said
        assert "nothing was changed" in said.splitlines()[-1], said
        assert {p: p.read_bytes() for p in sound} == sound, command
    assert set(out.rglob("*")) >= set(sound)


# -- 3. a damaged file is never listed in a manifest -------------------------------------------------------------
def test_a_flipped_byte_in_an_uploaded_local_file_is_found_before_the_manifest_and_recomputed(
    tmp_path, tiny_model, dataset, reference
):
    """On a local output only the size was checked before the manifest: a file with one byte changed was listed,
    the run ended "done", and `verify` found it afterwards."""
    copy_finished_run(reference, tmp_path)
    out = tmp_path / "out"
    (out / MANIFEST).unlink()
    victim = sorted(out.glob("shard-00000/*.safetensors"))[0]
    flip(victim, victim.stat().st_size // 2)  # inside the states: the size stays
    r = run_cli(*args_for(tmp_path, tiny_model, dataset))
    key = victim.relative_to(out).as_posix()
    assert f"output check: {key}: batch file CRC32" in r.stdout, r.stdout
    assert "recomputing 1 batch(es) of shard(s) [0]" in r.stdout and "done:" in r.stdout
    assert batch_bytes(out) == batch_bytes(reference / "out")
    assert_verified(out)


def test_staged_files_truncated_or_altered_after_a_crash_are_recomputed_not_uploaded(
    tmp_path, tiny_model, dataset, reference
):
    """A staged file with a readable header was uploaded as it was: its completion record then vouched for the
    damaged bytes, and the manifest listed them."""
    copy_finished_run(reference, tmp_path)
    out, run_dir = tmp_path / "out", tmp_path / "run"
    (out / MANIFEST).unlink()
    (run_dir / "COMPLETE").unlink()
    staging = run_staging_dir(tmp_path / "staging", run_dir) / "shard-00000"
    staging.mkdir(parents=True)
    truncated, altered = [b.key for b in Plan.load(run_dir / "plan.json").for_shard(0)[1:3]]
    for key in (truncated, altered):
        (out / key).unlink()
        (out / done_key(key)).unlink()
        shutil.copyfile(reference / "out" / key, staging / Path(key).name)
    with open(staging / Path(truncated).name, "r+b") as f:
        f.truncate(f.seek(0, 2) - 64)
    flip(staging / Path(altered).name, (staging / Path(altered).name).stat().st_size // 2)
    r = run_cli(*args_for(tmp_path, tiny_model, dataset))
    assert "done:" in r.stdout, r.stdout
    log = (run_dir / "logs" / "shard-00000.log").read_text()
    assert f"discarded staged file {Path(truncated).name}: its header describes" in log, log
    assert f"discarded staged file {Path(altered).name}: 1 sample(s) do not match their checksums" in log, log
    assert "0 staged to upload, 2 to compute" in log
    assert batch_bytes(out) == batch_bytes(reference / "out")
    assert_verified(out)


# -- 2. no process prints the endpoint's password ----------------------------------------------------------------
def test_no_command_prints_the_endpoint_password_in_its_retry_lines_or_errors(tmp_path, tiny_model, dataset):
    """botocore's own text ("Could not connect to the endpoint URL: http://user:PASS@...") was embedded in retry
    lines, which processes without the workers' redacting log handler printed as they were."""
    secret = "Pa55w0rdXYZ"
    endpoint = f"http://someone:{secret}@127.0.0.1:{free_port()}"
    output = "s3://bucket/prefix"
    commands = {
        "verify": ["verify", output, "--s3-endpoint-url", endpoint],
        "status": ["status", output, "--s3-endpoint-url", endpoint],
        "finalize": ["finalize", output, "--s3-endpoint-url", endpoint],
        "export": [
            "export",
            output,
            tmp_path / "dest",
            "--format",
            "speculators",
            "--s3-endpoint-url",
            endpoint,
        ],
        "run": args_for(tmp_path, tiny_model, dataset, output=output, s3_endpoint_url=endpoint),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "hsextract.cli", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(),
        )
        for name, args in commands.items()
    }
    # Every command gives up by itself on an endpoint it never reached (the run's preflight, the readers at their
    # first refused connection): each is waited for, however slow the machine, never cut off at a fixed time.
    seen = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    leaks = {name: text[-400:] for name, text in seen.items() if secret in text}
    assert not leaks, f"the password leaked: {leaks}"
    assert all(p.returncode == 2 for p in procs.values()), seen
    readers = {name: text for name, text in seen.items() if name != "run"}
    assert all("could not connect to the S3 endpoint http://***@127.0.0.1" in t for t in readers.values()), (
        seen
    )
    assert "could not reach http://***@127.0.0.1" in seen["run"], seen["run"]


# -- 5. states that overflow stop the run ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def overflowing_model(tmp_path_factory, tiny_model):
    """The tiny model with its embedding scaled by 1e6: in float16 every state is NaN (the embedding overflows)."""
    from safetensors.torch import load_file, save_file

    model = tmp_path_factory.mktemp("overflowing-model")
    for f in Path(tiny_model).iterdir():
        if f.is_file():
            shutil.copy(f, model / f.name)
    weights = load_file(model / "model.safetensors")
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name] = weights[name] * 1e6
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def test_a_float16_run_whose_states_overflow_stops_naming_batch_and_layer(tmp_path, overflowing_model):
    """It used to end "done" with every stored value NaN, and `verify` agreed. (Few short rows: float16 on the
    CPU is slow.)"""
    data = tmp_path / "short.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"s{i}", "input_ids": list(range(5, 25 + i)), "loss_mask": [1] * (20 + i)})
            + "\n"
            for i in range(4)
        )
    )
    args = args_for(
        tmp_path, overflowing_model, data, dtype="float16", shards=1, max_length=30, max_tokens_per_batch=50
    )
    r = run_cli(*args, check=False)
    text = r.stdout + r.stderr
    assert r.returncode == 1, text
    assert "Traceback" not in text
    assert (
        "shard 0 failed (exit 2): batch 0 (shard 0, shard-00000/batch-000000.safetensors): layer 0 has"
        in text
    )
    assert "token(s) with NaN or Inf values" in text and "in float16" in text and "--no-check-states" in text
    out = tmp_path / "out"
    assert not (out / MANIFEST).exists() and not list(out.glob("shard-*/*.safetensors"))
    staging = run_staging_dir(str(tmp_path / "staging"), tmp_path / "run")  # a failed run leaves no empty one
    assert not staging.exists(), list(staging.rglob("*"))
    # A user who knows better can store them.
    ok = run_cli(*args, "--no-check-states")
    assert "done:" in ok.stdout, ok.stdout


# -- loud: export ------------------------------------------------------------------------------------------------
def test_export_of_a_damaged_output_with_a_process_pool_names_the_file_instead_of_hanging(
    tmp_path, finished_run
):
    """The pool could not unpickle CorruptOutputError back in the parent and waited forever."""
    root = finished_run[0]
    out = shutil.copytree(root / "out", tmp_path / "out")
    victim = max(out.glob("shard-*/*.safetensors"), key=lambda p: p.stat().st_size)
    flip(victim, victim.stat().st_size // 2)
    args = (
        "export",
        out,
        tmp_path / "dest",
        "--format",
        "specforge-dflash",
        "--num-proc",
        2,
        "--no-progress",
    )
    r = run_cli(*args, check=False, timeout=240)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert f"{victim.relative_to(out).as_posix()}: " in text and "Traceback" not in text, text


def test_export_refuses_bad_vocabulary_options_before_writing_anything(tmp_path, finished_run):
    """--draft-vocab 0 | 100000 was refused only after every sample file was written, and DEST then recorded the
    bad value, so the corrected rerun was refused as another export; --target-vocab-size 10 was an IndexError."""
    out = finished_run[0] / "out"
    dest = tmp_path / "dest"
    base = ("export", out, dest, "--format", "specforge-dflash", "--num-proc", 1, "--no-progress")
    for extra, needle in [
        (("--draft-vocab", 0), "--draft-vocab 0 must be in 1.."),
        (("--draft-vocab", -5), "--draft-vocab -5 must be in 1.."),
        (("--draft-vocab", 100000), "--draft-vocab 100000 must be in 1.."),
        (("--draft-vocab", 8, "--target-vocab-size", 10), "--target-vocab-size 10 differs from the"),
    ]:
        r = run_cli(*base, *extra, check=False)
        text = r.stdout + r.stderr
        assert r.returncode == 2 and needle in text and "Traceback" not in text, text
        assert not dest.exists() or not any(dest.rglob("*")), sorted(dest.rglob("*"))
    ok = run_cli(*base, "--draft-vocab", 8)
    assert "exported" in ok.stdout and (dest / "vocab_mapping.pt").is_file(), ok.stdout


# -- a local output too small for the plan -----------------------------------------------------------------------
@pytest.fixture
def small_filesystem(tmp_path):
    """A real, separately mounted 1 MiB file system (tmpfs; needs root, as CI has)."""
    with mounted_tmpfs(tmp_path / "small-fs", "1m") as mount:
        yield mount


def test_a_local_output_without_room_for_the_plan_is_refused_before_the_model_loads(
    tmp_path, tiny_model, dataset, small_filesystem
):
    """It started, filled the file system (on a RAM disk: the host's memory) and failed mid-run."""
    out = small_filesystem / "out"
    r = run_cli(*args_for(tmp_path, tiny_model, dataset, output=out), check=False)
    text = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in text, text
    assert f"output directory {out} has 0.00" in text and "GB free but the plan's 18 batch file(s)" in text, (
        text
    )
    assert not (tmp_path / "run" / "logs").exists() and not list(out.rglob("*.safetensors"))


# -- loud: tracebacks and silences -------------------------------------------------------------------------------
def test_bad_ports_half_set_credentials_a_file_for_the_locks_and_a_fifo_get_messages_not_tracebacks(
    tmp_path, tiny_model, dataset, reference
):
    partial = cli_env()
    del partial["AWS_SECRET_ACCESS_KEY"]
    locks = tmp_path / "locked"
    (locks / "run").mkdir(parents=True)
    (locks / "run" / "locks").write_text("a file")
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    cases = [
        (["status", reference / "run", "--serve", "--port", "70000"], None, "70000 is not in the range"),
        (["status", reference / "run", "--serve", "--port", "-1"], None, "-1 is not in the range"),
        (
            ["verify", "s3://bucket/x", "--s3-endpoint-url", f"http://127.0.0.1:{free_port()}"],
            partial,
            "no usable AWS credentials",
        ),
        (args_for(locks, tiny_model, dataset), None, "locks is a file where the run dir keeps its locks"),
        (args_for(tmp_path, tiny_model, fifo), None, "is not a regular file (a FIFO"),
    ]
    for args, env, needle in cases:
        r = subprocess.run(
            [sys.executable, "-m", "hsextract.cli", *map(str, args)],
            capture_output=True,
            text=True,
            env=env or cli_env(),
            timeout=120,
        )
        text = r.stdout + r.stderr
        assert r.returncode == 2 and needle in text and "Traceback" not in text, (args, text)


def test_status_page_on_a_public_address_warns_that_it_has_no_authentication(reference):
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hsextract.cli",
            "status",
            reference / "run",
            "--serve",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ctrl-C as a terminal sends it, even where the harness runs in the background (SIGINT ignored there).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        lines = [p.stdout.readline(), p.stdout.readline()]
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=30)
    assert lines[0].startswith("serving the status of"), lines
    assert lines[1].startswith("warning: listening on 0.0.0.0") and "no authentication" in lines[1], lines


def test_sigint_to_the_launcher_is_the_signal_status_names(tmp_path, tiny_model, dataset):
    """The launcher passed every stop on as SIGTERM: after a SIGINT `status` said "stopped by SIGTERM"."""
    args = args_for(tmp_path, tiny_model, dataset, max_tokens_per_batch=300)
    with launched(args, tmp_path) as proc:
        wait_for(lambda: done_count(tmp_path / "run") >= 1, "a durable batch", proc=proc, root=tmp_path)
        # mid-run when the signal lands, however loaded the machine
        frozen_while_computing(tmp_path / "run", proc, tmp_path)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 128 + signal.SIGINT, launcher_output(tmp_path)
    assert "terminated by SIGINT" in launcher_output(tmp_path)
    rows = status_json(tmp_path / "run")["shards"]
    stopped = [r for r in rows if r["state"] == "stopped"]
    assert stopped and all(r["error"] == "stopped by SIGINT" for r in stopped), rows


def test_an_s3_output_emptied_or_its_endpoint_swapped_for_an_empty_one_is_recomputed_by_the_same_command(
    tmp_path, tiny_model, dataset, reference, s3, s3_bucket
):
    """The same finding on S3 (a prefix deleted; an endpoint replaced by an empty one: a second S3 server): every
    rerun said "N of N batches still to do", exit 0, no manifest."""
    output = f"s3://{s3_bucket}/job"
    args = args_for(tmp_path, tiny_model, dataset, output=output, s3_endpoint_url=s3.url)
    run_cli(*args, env=cli_env(), timeout=400)
    client = s3.client()
    for key in s3.object_keys(s3_bucket):
        client.delete_object(Bucket=s3_bucket, Key=key)
    r = run_cli(*args, env=cli_env(), timeout=400)
    assert "done:" in r.stdout, r.stdout
    assert_s3_output_is(s3, s3_bucket, reference)

    with S3Endpoint() as other:  # another server, on other ports, holding nothing
        other.create_bucket(s3_bucket)
        swapped = [other.url if a == s3.url else a for a in map(str, args)]
        r = run_cli(*swapped, env=cli_env(), timeout=400)
        assert "done:" in r.stdout, r.stdout
        assert_s3_output_is(other, s3_bucket, reference)


def assert_s3_output_is(endpoint, bucket: str, reference: Path) -> None:
    """The output ``s3://bucket/job`` holds the reference run's batch files, byte for byte, and verifies clean."""
    got = {
        k[len("job/") :]: endpoint.get_object(bucket, k)
        for k in endpoint.object_keys(bucket)
        if k.startswith("job/shard-")
    }
    assert got == batch_bytes(reference / "out")
    assert f"job/{MANIFEST}" in endpoint.object_keys(bucket)
    v = run_cli("verify", f"s3://{bucket}/job", "--s3-endpoint-url", endpoint.url, env=cli_env(), check=False)
    assert v.returncode == 0 and "all good" in v.stdout, v.stdout + v.stderr


def test_a_rerun_after_sigint_says_it_resumes_with_the_count_the_interruption_gave(
    tmp_path, tiny_model, dataset
):
    """After a SIGINT the launcher said "1 of 13 batches are finished and kept" and the rerun said nothing about
    resuming (a shard log said 2 were done)."""
    import re

    args = args_for(tmp_path, tiny_model, dataset, max_tokens_per_batch=300)
    with launched(args, tmp_path) as proc:
        wait_for(lambda: done_count(tmp_path / "run") >= 1, "a durable batch", proc=proc, root=tmp_path)
        # mid-run when the signal lands, however loaded the machine
        frozen_while_computing(tmp_path / "run", proc, tmp_path)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 128 + signal.SIGINT, launcher_output(tmp_path)
    said = re.search(r"(\d+) of (\d+) batches are in the output and kept", launcher_output(tmp_path))
    assert said, launcher_output(tmp_path)
    rerun = run_cli(*args)
    resumed = re.search(r"resuming: (\d+) of (\d+) batches are in the output already", rerun.stdout)
    assert resumed, rerun.stdout
    assert resumed.groups() == said.groups(), (launcher_output(tmp_path), rerun.stdout)
    assert_verified(tmp_path / "out")
