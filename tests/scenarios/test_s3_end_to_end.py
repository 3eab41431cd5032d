"""The S3 path of the real CLI: ``hsextract run`` in real processes against a real endpoint (SeaweedFS's S3 server on
loopback, see s3server.py), checked against the same run to a local directory.

A run to ``s3://bucket/prefix`` must upload every batch once, byte-identical to the local run's files (CPU float32
forwards are deterministic), leave staging empty and be readable by ``open_output`` on S3. It must survive the
endpoint going away mid-run, refuse bad credentials, a missing bucket or an unreachable endpoint in seconds and
before any weight loads, wait rather than fail when the staging budget is tiny, and, when a worker's uploader is
killed, fail naming the shard and resume to the same output.

Every run uses small batches (300 tokens, 4 rows: ~17 batches per shard) so that the outage and the kill fall
mid-run; the kill point is pinned by freezing the uploader (SIGSTOP) first, not raced.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from support.cli import (
    RUN_TIMEOUT_S,
    TINY_LIMITS,
    cli_run_args,
    launched,
    wait_for,
    write_mixed_dataset,
)
from support.damage import DAMAGED_ROW, flip_in_states
from support.procs import freeze
from support.s3server import S3Endpoint, cli_env, free_port

from hsextract.config import run_staging_dir
from hsextract.errors import CorruptOutputError
from hsextract.output import Plan, open_output
from hsextract.output.records import DONE_PREFIX, JOB
from hsextract.run.progress import ShardProgress

# aws_test_env: fake credentials for the boto3 clients of this process (the reader); the CLI gets its own (cli_env).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("aws_test_env")]

PREFIX = "runs/e2e"
OUTAGE_S = 4.0
PREFLIGHT_LIMIT_S = 30


# -- running the CLI ----------------------------------------------------------------------------------------------
def run_args(root: Path, model, data, output: str, *extra) -> list[str]:
    """``hsextract run`` on CPU with small batches, run dir and staging under ``root``."""
    options = dict(
        output=output,
        layers="0,3,7",
        shards=2,
        **{**TINY_LIMITS, "max_tokens_per_batch": 300, "max_rows": 4},
        num_proc=1,  # a pool of 2 costs more than it saves on 58 rows
        no_progress=True,
    )
    return [*cli_run_args(root, model, data, **options), *extra]


def s3_args(root: Path, model, data, s3: S3Endpoint, bucket: str, *extra) -> list[str]:
    return run_args(root, model, data, f"s3://{bucket}/{PREFIX}", "--s3-endpoint-url", s3.url, *extra)


def hsextract(args, *, env=None, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
    )


def succeeded(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "done:" in r.stdout
    return r


def uploader_children(worker_pid: int) -> list[int]:
    """The worker's ``spawn`` children: its uploader once started (multiprocessing's resource tracker is not one)."""
    try:
        import psutil

        children = []
        for child in psutil.Process(worker_pid).children():
            try:
                children.append((child.pid, " ".join(child.cmdline())))
            except psutil.Error:  # exited meanwhile
                pass
    except ImportError:
        ps = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(worker_pid)], capture_output=True, text=True
        )
        children = [
            (int(pid), args)
            for pid, _, args in (line.strip().partition(" ") for line in ps.stdout.splitlines())
        ]
    return [pid for pid, cmdline in children if "spawn_main" in cmdline]


def uploader_pid(worker_pid: int) -> int:
    pids = uploader_children(worker_pid)
    assert len(pids) == 1, f"expected one uploader child of worker {worker_pid}, found {pids}"
    return pids[0]


def started_uploader(run_dir: Path, shard: int) -> int | None:
    """Shard ``shard``'s uploader pid once its worker has started it, else None."""
    progress = ShardProgress.load(run_dir, shard)
    if progress is None:
        return None
    try:
        pids = uploader_children(progress.pid)
    except Exception:  # the worker exited meanwhile (psutil.NoSuchProcess)
        return None
    return pids[0] if len(pids) == 1 else None


def shard_log(run_dir: Path, shard: int) -> Path:
    return run_dir / "logs" / f"shard-{shard:05d}.log"


def staged_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "staging").rglob("*") if p.is_file())


# -- the output ---------------------------------------------------------------------------------------------------
def local_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def assert_s3_output_equals_reference(s3: S3Endpoint, bucket: str, root: Path, reference: Path) -> None:
    """Exactly the reference's objects under the prefix (each batch once, no extras, no probe), every batch
    byte-identical, the manifest equal, a completion record for every batch, nothing left in staging."""
    expected = local_files(reference)
    client = s3.client()  # one client: making one costs more than a small get_object
    keys = s3.object_keys(bucket)
    assert keys == [f"{PREFIX}/{key}" for key in sorted(expected)], (
        "objects missing from or extra in the bucket"
    )

    def stored(key: str) -> bytes:
        return client.get_object(Bucket=bucket, Key=f"{PREFIX}/{key}")["Body"].read()

    batches = [key for key in expected if key.startswith("shard-")]
    same_bytes = [
        key for key in expected if key not in ("manifest.json", JOB)
    ]  # batches and completion records
    differing = [key for key in same_bytes if stored(key) != expected[key]]
    assert not differing, f"objects differ from the local run's files: {differing}"
    manifest = json.loads(stored("manifest.json"))
    assert manifest == json.loads(expected["manifest.json"])
    assert (
        json.loads(stored(JOB))["plan_hash"]
        == json.loads(expected[JOB])["plan_hash"]
        == manifest["plan_hash"]
    )
    assert sorted(b["key"] for b in manifest["batches"]) == sorted(batches)
    assert recorded_done(s3, bucket) == set(batches)
    assert not staged_files(root), f"files left in staging: {staged_files(root)}"


def recorded_done(s3: S3Endpoint, bucket: str, shard: int | None = None) -> set[str]:
    """The batch keys the S3 output records done: its completion records."""
    prefix = f"{PREFIX}/{DONE_PREFIX}"
    shard_prefix = prefix + ("" if shard is None else f"shard-{shard:05d}/")
    return {k[len(prefix) : -len(".json")] for k in s3.object_keys(bucket) if k.startswith(shard_prefix)}


def uploaded_count(run_dir: Path) -> int:
    """Batches the uploaders logged as uploaded and recorded, read while the endpoint may be down."""
    return sum(p.read_text().count("uploaded shard-") for p in (run_dir / "logs").glob("*.uploader.log"))


# -- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_mixed_dataset(tmp_path_factory.mktemp("s3-e2e-data") / "data.jsonl", tiny_tokenizer)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, dataset) -> Path:
    """The same run to a local directory: the output every S3 run must equal."""
    root = tmp_path_factory.mktemp("s3-e2e-local")
    succeeded(hsextract(run_args(root, tiny_model, dataset, str(root / "out"))))
    plan = Plan.load(root / "run" / "plan.json")
    assert min(len(plan.for_shard(s)) for s in range(plan.shards)) >= 12, "too few batches to fall mid-run"
    return root / "out"


@pytest.fixture(scope="module")
def s3_run(tmp_path_factory, s3: S3Endpoint, tiny_model, dataset) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("s3-e2e-s3")
    bucket = s3.create_bucket()
    succeeded(hsextract(s3_args(root, tiny_model, dataset, s3, bucket)))
    return root, bucket


# -- 1. a run to S3 equals a run to a local directory ---------------------------------------------------------------
def test_run_to_s3_uploads_each_batch_byte_identical_to_a_local_run(s3: S3Endpoint, s3_run, reference):
    root, bucket = s3_run
    assert_s3_output_equals_reference(s3, bucket, root, reference)


def test_reader_on_s3_gives_the_states_of_the_local_output(s3: S3Endpoint, s3_run, reference):
    _, bucket = s3_run
    remote = open_output(f"s3://{bucket}/{PREFIX}", endpoint_url=s3.url)
    local = open_output(str(reference))
    assert remote.layer_ids == local.layer_ids == (0, 3, 7)
    assert remote.sample_ids() == local.sample_ids() and len(remote) > 0
    for a, b in zip(remote, local, strict=True):
        assert a["sample_id"] == b["sample_id"]
        for name in ("input_ids", "loss_mask", "hidden_states"):
            assert torch.equal(a[name], b[name]), (a["sample_id"], name)
        assert a["layers"].keys() == b["layers"].keys()
        assert all(torch.equal(a["layers"][k], b["layers"][k]) for k in a["layers"])
    some = local.sample_ids()[len(local) // 2]
    assert torch.equal(remote[some]["hidden_states"], local[some]["hidden_states"])


def test_verify_on_s3_passes_the_run_and_names_exactly_a_damaged_object(
    s3: S3Endpoint, s3_run, tmp_path: Path
):
    _, bucket = s3_run
    clean = hsextract(["verify", f"s3://{bucket}/{PREFIX}", "--s3-endpoint-url", s3.url])
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "all good" in clean.stdout
    # A copy of the output under another prefix, one object with a byte flipped inside one sample's states.
    client, copy = s3.client(), "runs/damaged"
    for key in s3.object_keys(bucket):
        if key.startswith(f"{PREFIX}/"):
            client.copy_object(
                Bucket=bucket,
                Key=f"{copy}/{key[len(PREFIX) + 1 :]}",
                CopySource={"Bucket": bucket, "Key": key},
            )
    batches = json.loads(s3.get_object(bucket, f"{copy}/manifest.json"))["batches"]
    entry = next(b for b in batches if len(b["sample_ids"]) > DAMAGED_ROW)
    local = tmp_path / "batch.safetensors"
    local.write_bytes(s3.get_object(bucket, f"{copy}/{entry['key']}"))
    flip_in_states(local)
    client.put_object(Bucket=bucket, Key=f"{copy}/{entry['key']}", Body=local.read_bytes())

    r = hsextract(["verify", f"s3://{bucket}/{copy}", "--s3-endpoint-url", s3.url, "--json"])
    assert r.returncode == 1, r.stdout + r.stderr
    bad = json.loads(r.stdout)["bad"]
    assert [b["url"] for b in bad] == [f"s3://{bucket}/{copy}/{entry['key']}"]
    assert "1 sample(s) do not match their checksums" in bad[0]["problem"]
    with pytest.raises(CorruptOutputError, match="does not match its checksum"):
        open_output(f"s3://{bucket}/{copy}", endpoint_url=s3.url)[entry["sample_ids"][DAMAGED_ROW]]


# -- 2. the endpoint goes away mid-run and comes back -------------------------------------------------------------
def test_endpoint_outage_mid_run_is_ridden_out_and_each_batch_uploaded_once(
    s3: S3Endpoint, s3_bucket: str, tmp_path: Path, tiny_model, dataset, reference
):
    run_dir = tmp_path / "run"
    total = len(local_files(reference)) - 1
    with launched(s3_args(tmp_path, tiny_model, dataset, s3, s3_bucket), tmp_path, env=cli_env()) as proc:
        wait_for(lambda: uploaded_count(run_dir), "a first uploaded batch", proc=proc, root=tmp_path)
        s3.stop()
        down_since = time.monotonic()
        time.sleep(1.0)  # requests that were in flight when the server stopped have ended
        marked = uploaded_count(run_dir)
        assert marked < total, "every batch was uploaded before the outage: it did not fall mid-run"
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_since)))
        assert proc.poll() is None, (
            "the run ended during the outage:\n" + (tmp_path / "launcher.out").read_text()
        )
        assert uploaded_count(run_dir) == marked, "a batch was recorded while the endpoint was down"
        s3.start()
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    output = (tmp_path / "launcher.out").read_text()
    assert rc == 0, output
    assert "done:" in output
    uploader_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.uploader.log"))
    assert f"could not reach {s3.url}" in uploader_logs, "the uploaders never saw the outage"
    assert_s3_output_equals_reference(s3, s3_bucket, tmp_path, reference)


# -- 3. bad credentials, a missing bucket, an unreachable endpoint: exit 2 in seconds, before the model loads -----
def fails_before_the_model_loads(args, root: Path, *needles: str, env=None) -> str:
    start = time.monotonic()
    r = hsextract(args, env=env, timeout=60)
    elapsed = time.monotonic() - start
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr
    assert elapsed < PREFLIGHT_LIMIT_S, f"took {elapsed:.0f} s"
    logs = root / "run" / "logs"
    assert not (logs.exists() and list(logs.glob("shard-*"))), "a worker was started"
    assert not (root / "run" / "plan.json").exists()
    return r.stderr


def test_refused_credentials_fail_before_the_model_loads(
    s3: S3Endpoint, s3_bucket: str, tmp_path: Path, tiny_model, dataset
):
    # One refusal through the CLI; test_storage checks preflight's other ones (wrong secret, denied access).
    fails_before_the_model_loads(
        s3_args(tmp_path, tiny_model, dataset, s3, s3_bucket),
        tmp_path,
        f"credentials were refused by {s3.url}",
        "InvalidAccessKeyId",
        "AWS_ACCESS_KEY_ID",
        env=cli_env(AWS_ACCESS_KEY_ID="AKIAUNKNOWNKEY000000"),
    )
    assert s3.object_keys(s3_bucket) == [], "something was written to the bucket"


def test_missing_bucket_fails_before_the_model_loads(s3: S3Endpoint, tmp_path: Path, tiny_model, dataset):
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    fails_before_the_model_loads(
        s3_args(tmp_path, tiny_model, dataset, s3, bucket),
        tmp_path,
        f"bucket '{bucket}' does not exist at {s3.url}",
        f"s3://{bucket}/{PREFIX}",
    )
    buckets = [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    assert bucket not in buckets, "the missing bucket was created"


def test_unreachable_endpoint_fails_before_the_model_loads(tmp_path: Path, tiny_model, dataset):
    endpoint = f"http://127.0.0.1:{free_port()}"
    args = run_args(tmp_path, tiny_model, dataset, f"s3://bucket/{PREFIX}", "--s3-endpoint-url", endpoint)
    fails_before_the_model_loads(args, tmp_path, f"could not reach {endpoint}")


# -- 4. a tiny staging budget: workers wait for the uploader -------------------------------------------------------
def test_tiny_staging_budget_makes_workers_wait_not_fail(
    s3: S3Endpoint, s3_bucket: str, tmp_path: Path, tiny_model, dataset, reference
):
    # 300 kB: one batch file (at most 300 tokens x 3 layers x 64 x 4 bytes = 230 kB) and not two, so a batch waits
    # until the one before it is uploaded (a budget under one file is refused). Shard 0's uploader is frozen until
    # its worker says it waits: on a loaded machine an uploader left alone kept up with every batch.
    run_dir = tmp_path / "run"
    args = s3_args(tmp_path, tiny_model, dataset, s3, s3_bucket, "--staging-max-gb", "0.0003")

    def waiting() -> bool:
        log = shard_log(run_dir, 0)
        return log.exists() and "waiting for the uploader" in log.read_text()

    with launched(args, tmp_path, env=cli_env()) as proc:
        uploader = wait_for(
            lambda: started_uploader(run_dir, 0), "shard 0's uploader", proc=proc, root=tmp_path, timeout=120
        )
        freeze(uploader)
        wait_for(waiting, "shard 0 waiting for its uploader", proc=proc, root=tmp_path)
        os.kill(uploader, signal.SIGCONT)
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    assert rc == 0, (tmp_path / "launcher.out").read_text()
    assert "staging drained; continuing" in shard_log(run_dir, 0).read_text()
    assert_s3_output_equals_reference(s3, s3_bucket, tmp_path, reference)


# -- 5. the uploader dies mid-run ----------------------------------------------------------------------------------
# The uploader is frozen as soon as it exists and let run in short pulses: the kill falls after the first record and
# before the last whatever the machine's load.
def test_uploader_killed_mid_run_fails_its_shard_and_the_rerun_uploads_each_batch_once(
    s3: S3Endpoint, s3_bucket: str, tmp_path: Path, tiny_model, dataset, reference
):
    run_dir = tmp_path / "run"
    staging = run_staging_dir(str(tmp_path / "staging"), run_dir) / "shard-00000"
    args = s3_args(tmp_path, tiny_model, dataset, s3, s3_bucket)
    shard0_total = sum(key.startswith("shard-00000/") for key in local_files(reference))

    def unmarked_staged() -> list[str]:
        done = recorded_done(s3, s3_bucket, 0)
        return [p.name for p in staging.glob("*.safetensors") if f"shard-00000/{p.name}" not in done]

    with launched(args, tmp_path, env=cli_env()) as proc:
        uploader = wait_for(
            lambda: started_uploader(run_dir, 0), "shard 0's uploader", proc=proc, root=tmp_path, timeout=120
        )
        # Frozen, the uploader records nothing while its worker goes on staging batches: the kill then leaves
        # complete batch files in staging that no completion record covers.
        freeze(uploader)

        def pulse() -> int:
            os.kill(uploader, signal.SIGCONT)
            time.sleep(0.05)
            freeze(uploader)
            time.sleep(0.05)  # a request it sent just before is answered before the listing
            return len(recorded_done(s3, s3_bucket, 0))

        marked = wait_for(pulse, "a first uploaded batch of shard 0", proc=proc, root=tmp_path)
        assert marked < shard0_total, "the kill did not fall mid-run"
        wait_for(unmarked_staged, "a staged batch not yet uploaded", proc=proc, root=tmp_path)
        os.kill(uploader, signal.SIGKILL)
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    output = (tmp_path / "launcher.out").read_text()
    assert rc == 1, output
    assert "shard 0 failed (exit 2): the uploader process was killed by SIGKILL" in output
    assert f"log: {shard_log(run_dir, 0)}" in output
    assert "shard 1 failed" not in output and "Rerun the same command" in output
    assert len(recorded_done(s3, s3_bucket, 0)) == marked, "batches were recorded after the uploader died"
    left = unmarked_staged()
    assert left, "the batches the uploader had not finished were not kept in staging"
    assert not [p for p in staging.iterdir() if not p.name.endswith(".safetensors")], (
        "partial files in staging"
    )
    assert f"{PREFIX}/manifest.json" not in s3.object_keys(s3_bucket), "a manifest for an incomplete output"

    recorded = recorded_done(s3, s3_bucket, 0)
    log_start = shard_log(run_dir, 0).stat().st_size
    rerun = succeeded(hsextract(args))
    assert "shards already complete: [1]" in rerun.stdout
    with open(shard_log(run_dir, 0)) as f:
        f.seek(log_start)
        session = f.read()
    # Every batch recorded before the kill is done, even one whose staged copy was not yet deleted; the staged
    # files without a record are uploaded, not recomputed.
    done = recorded
    staged_left = [name for name in left if f"shard-00000/{name}" not in recorded]
    resume_line = next(ln for ln in session.splitlines() if "resume: " in ln and " batches done, " in ln)
    assert f"resume: {len(done)} batches done, {len(staged_left)} staged to upload" in resume_line, (
        resume_line,
        marked,
        left,
        sorted(recorded),
    )
    assert_s3_output_equals_reference(s3, s3_bucket, tmp_path, reference)


def test_start_up_reads_each_completion_record_once(
    s3: S3Endpoint, s3_bucket: str, tmp_path: Path, tiny_model, dataset, reference
):
    """The launcher picks the shards to start from one listing of the records, each worker checks its shard's, and
    finalize checks them all: a rerun with one batch of each shard undone reads each record twice in all, once at
    start-up, once in the check before the manifest."""
    args = s3_args(tmp_path, tiny_model, dataset, s3, s3_bucket)
    succeeded(hsextract(args))
    client = s3.client()
    undone = [
        f"shard-{s:05d}/batch-{Plan.load(tmp_path / 'run' / 'plan.json').for_shard(s)[0].batch_id:06d}.safetensors"
        for s in (0, 1)
    ]
    for key in undone:
        for name in (key, f"{DONE_PREFIX}{key}.json"):
            client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/{name}")
    recorded = [
        k[len(f"{PREFIX}/{DONE_PREFIX}") : -len(".json")]
        for k in s3.object_keys(s3_bucket)
        if k.startswith(f"{PREFIX}/{DONE_PREFIX}")
    ]
    with s3.requests() as requests:
        succeeded(hsextract(args))
    done_path = f"/{s3_bucket}/{PREFIX}/{DONE_PREFIX}"
    reads = Counter(
        path[len(done_path) : -len(".json")]
        for method, path in requests
        if method == "GET" and path.startswith(done_path)
    )
    assert reads == {**{k: 2 for k in recorded}, **{k: 1 for k in undone}}, reads
    assert_s3_output_equals_reference(s3, s3_bucket, tmp_path, reference)
