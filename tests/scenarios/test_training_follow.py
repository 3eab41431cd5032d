"""``StatesDataset(output, follow=True)``: training while ``hsextract run`` still writes the output, in real rank
processes with real DataLoader workers, on a local directory and on the S3 server on loopback. The reference is the
reader on the finished output (values) and its manifest (which samples exist)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.cli import (
    copy_finished_run,
    crash_run_args,
    launched,
    launcher_output,
    rehomed_args,
    run_cli,
    write_mixed_dataset,
)
from support.s3server import S3Endpoint, cli_env
from torch.utils.data import DataLoader

from hsextract.errors import HsextractError
from hsextract.output import open_output
from hsextract.output.manifest import MANIFEST
from hsextract.output.records import done_key
from hsextract.training import StatesDataset

pytestmark = pytest.mark.slow

# One rank of a training job: follows the output with 2 DataLoader workers, saves what its loop received, and
# counts the batches it received before the manifest existed.
RANK = """
import sys, torch
from torch.utils.data import DataLoader
from hsextract.storage import open_sink
from hsextract.training import StatesDataset
output, rank, dest, endpoint = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] or None
data = StatesDataset(output, rank=rank, world_size=2, batch_size=2, follow=True, poll_s=0.2,
                     follow_timeout_s=120, endpoint_url=endpoint, dtype=torch.float32, seed=3)
sink = open_sink(output, endpoint)
got, early = [], 0
for batch in DataLoader(data, batch_size=2, num_workers=2, collate_fn=list):
    early += not sink.exists("manifest.json")
    got += [{k: s[k] for k in ("sample_id", "hidden_states", "input_ids", "loss_mask")} for s in batch]
torch.save({"samples": got, "early": early, "len": len(data)}, dest)
"""


def manifest_ids(output: Path) -> list[str]:
    manifest = json.loads((output / MANIFEST).read_text())
    return [sid for b in manifest["batches"] for sid in b["sample_ids"]]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_mixed_dataset(tmp_path_factory.mktemp("follow-data") / "data.jsonl", tiny_tokenizer)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_ranks_follow_a_live_run_and_see_every_sample_once(where, tmp_path, tiny_model, dataset, request):
    if where == "s3":
        request.getfixturevalue("aws_test_env")
        s3: S3Endpoint = request.getfixturevalue("s3")
        bucket = request.getfixturevalue("s3_bucket")
        output, endpoint, env = f"s3://{bucket}/follow", s3.url, cli_env()
        extra = {"output": output, "s3_endpoint_url": s3.url}
    else:
        output, endpoint, env = str(tmp_path / "out"), "", None
        extra = {}
    args = crash_run_args(tmp_path, tiny_model, dataset, no_progress=True, **extra)
    with launched(args, tmp_path, env=env) as run:
        # The ranks start with the run, before its output exists: they wait for the job files, then follow.
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, output, str(r), str(tmp_path / f"rank{r}.pt"), endpoint],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            for r in range(2)
        ]
        for p in ranks:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, out
        assert run.wait(timeout=60) == 0, launcher_output(tmp_path)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # Training overlapped the extraction: batches were handed to the loop before the manifest existed.
    assert got[0]["early"] + got[1]["early"] > 0
    finished = open_output(output, endpoint or None, dtype=torch.float32)
    expected = finished.sample_ids()
    seen = [s["sample_id"] for g in got for s in g["samples"]]
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))
    assert [len(g["samples"]) for g in got] == [g["len"] for g in got]
    assert abs(len(got[0]["samples"]) - len(got[1]["samples"])) <= 1
    for s in (s for g in got for s in g["samples"]):
        want = finished[s["sample_id"]]
        for k in ("hidden_states", "input_ids", "loss_mask"):
            assert torch.equal(s[k], want[k]), (s["sample_id"], k)


def ids(batch):
    return [s["sample_id"] for s in batch]


def loop(data, workers: int, stop_after: int | None = None) -> list[str]:
    out = []
    for k, batch in enumerate(DataLoader(data, batch_size=2, num_workers=workers, collate_fn=ids)):
        if k == stop_after:
            break
        out += batch
    return out


def test_a_followed_state_resumes_to_exactly_the_rest(finished_run):
    out = finished_run[0] / "out"
    expected = manifest_ids(out)

    def followed():
        return StatesDataset(out, rank=1, world_size=2, batch_size=2, follow=True, poll_s=0.05, seed=9)

    data = followed()
    whole = loop(data, workers=2)
    assert len(whole) == len(data) == len(expected) // 2 and len(set(whole)) == len(whole)
    other = loop(StatesDataset(out, rank=0, world_size=2, batch_size=2, follow=True, poll_s=0.05, seed=9), 2)
    assert sorted(whole + other) == sorted(expected)

    head = loop(data, workers=2, stop_after=3)  # the job dies after 3 steps
    state = json.loads(json.dumps(data.state_dict(consumed=len(head))))  # as a checkpoint stores it
    assert (
        state["consumed"] == 6 and sum(len(v) for v in state["consumed_samples"].values() if v != "all") <= 6
    )
    resumed = followed()
    resumed.load_state_dict(state)
    rest = loop(resumed, workers=2)
    assert sorted(head + rest) == sorted(whole) and not set(head) & set(rest)
    # Twice: a second interruption, taken on top of the first, and the rest without workers.
    more = loop(resumed, workers=2, stop_after=2)
    again = followed()
    again.load_state_dict(resumed.state_dict(consumed=len(more)))
    last = loop(again, workers=0)
    assert sorted(head + more + last) == sorted(whole) and len(head + more + last) == len(whole)
    with pytest.raises(HsextractError, match="seed=9"):
        StatesDataset(out, rank=1, world_size=2, follow=True, seed=1).load_state_dict(state)
    with pytest.raises(HsextractError, match="consumed=99"):
        followed().state_dict(consumed=99)


def test_a_followed_state_with_a_skipping_schema_resumes_to_exactly_the_rest_near_the_end(finished_run):
    """DFlash's schema leaves out samples without two consecutive loss tokens, so the two workers' shares differ and
    one runs out first; a state taken at any of the last steps still resumes to exactly the rest."""
    import hashlib

    from hsextract.training import StatesMapDataset

    out = finished_run[0] / "out"
    assert StatesMapDataset(out, "specforge-dflash").index.skipped  # the schema does leave samples out here

    def key(s):  # DFlash items carry no id: the tokens and the states' sum tell them apart
        return hashlib.sha1(
            s["input_ids"].numpy().tobytes() + s["hidden_states"].sum().numpy().tobytes()
        ).hexdigest()

    def run(data, stop_after=None):
        got = []
        loader = DataLoader(data, batch_size=2, num_workers=2, collate_fn=lambda b: [key(s) for s in b])
        for k, batch in enumerate(loader):
            if k == stop_after:
                break
            got += batch
        return got

    def followed():
        return StatesDataset(
            out, "specforge-dflash", rank=1, world_size=2, batch_size=2, follow=True, poll_s=0.05, seed=9
        )

    data = followed()
    whole = run(data)
    assert len(set(whole)) == len(whole) > 8
    steps = (len(whole) + 1) // 2
    for stop in range(steps - 3, steps):
        head = run(data, stop_after=stop)
        resumed = followed()
        resumed.load_state_dict(json.loads(json.dumps(data.state_dict(consumed=len(head)))))
        rest = run(resumed)
        assert sorted(head + rest) == sorted(whole) and not set(head) & set(rest), stop


def test_an_output_whose_run_stopped_is_served_as_far_as_it_goes_then_times_out(finished_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_run[0] / "out", out)
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).unlink()
    missing = manifest["batches"][-3:]  # the run died before these batches were done
    for b in missing:
        (out / done_key(b["key"])).unlink()
    data = StatesDataset(out, follow=True, poll_s=0.05, follow_timeout_s=1.5)
    served = []
    with pytest.raises(
        HsextractError,
        match=rf"no batch completed .*\({len(manifest['batches']) - 3} of {len(manifest['batches'])} batches",
    ):
        for s in data:
            served.append(s["sample_id"])
    lost = {sid for b in missing for sid in b["sample_ids"]}
    assert sorted(served) == sorted(set(manifest_ids(finished_run[0] / "out")) - lost)
    with pytest.raises(HsextractError, match="the job files of .* did not appear"):
        StatesDataset(tmp_path / "nothing-here", follow=True, poll_s=0.05, follow_timeout_s=0.3)


def test_a_follower_of_a_run_restarted_onto_a_new_plan_stops_loudly(finished_run, tmp_path):
    """The followed run is restarted with --restart onto another plan (other batch limits) while a follower has
    served part of it: the follower raises naming the output, and what it served before is the first plan's."""
    copy_finished_run(finished_run[0], tmp_path)
    out = tmp_path / "out"
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).unlink()  # the first run as it was before its last batches
    (tmp_path / "run" / "COMPLETE").unlink(missing_ok=True)
    for b in manifest["batches"][-3:]:
        (out / done_key(b["key"])).unlink()
    data = StatesDataset(
        out, follow=True, poll_s=0.05, follow_timeout_s=900, shuffle=False, dtype=torch.float32
    )
    it = iter(data)
    served = [next(it) for _ in range(3)]

    run_cli(*rehomed_args(finished_run[3], tmp_path, max_rows=4), "--restart", timeout=600)
    assert json.loads((out / MANIFEST).read_text())["plan_hash"] != manifest["plan_hash"]

    with pytest.raises(HsextractError) as e:
        for s in it:
            served.append(s)
    assert str(out) in str(e.value), e.value
    reference = open_output(str(finished_run[0] / "out"), dtype=torch.float32)
    for s in served:
        assert torch.equal(s["hidden_states"], reference[s["sample_id"]]["hidden_states"]), s["sample_id"]


@pytest.mark.usefixtures("aws_test_env")
def test_following_over_s3_with_the_server_stopped_mid_epoch_fails_naming_the_output(
    finished_run, s3: S3Endpoint, s3_bucket: str
):
    """The S3 server stops while a follower waits for the last batches: after the storage's retry deadline (10 s
    here) the follower raises an ``HsextractError`` naming the output and saying it gave up; it does not hang."""
    out = finished_run[0] / "out"
    manifest = json.loads((out / MANIFEST).read_text())
    held_back = {done_key(b["key"]) for b in manifest["batches"][-3:]}
    client = s3.client()
    for path in sorted(out.rglob("*")):
        key = path.relative_to(out).as_posix()
        if path.is_file() and key != MANIFEST and key not in held_back:
            client.upload_file(str(path), s3_bucket, f"live/{key}")
    url = f"s3://{s3_bucket}/live"
    data = StatesDataset(
        url,
        endpoint_url=s3.url,
        follow=True,
        poll_s=0.05,
        follow_timeout_s=900,
        shuffle=False,
        retry_deadline_s=10,
    )
    it = iter(data)
    served = [next(it)["sample_id"] for _ in range(3)]
    s3.stop()
    try:
        started = time.monotonic()
        with pytest.raises(HsextractError, match=rf"gave up on the .* in {url}") as e:
            for s in it:
                served.append(s["sample_id"])
        assert time.monotonic() - started < 120, e.value
    finally:
        s3.start()
    assert set(served) <= set(manifest_ids(out))
