"""No metadata step grows faster than the output: finalize, status, opening the output and making a training
dataset over it, on synthetic plans of 500 and 5,000 batches (job files, completion records, manifest and sample
index as a run leaves them; no batch file is read by these steps, so none is written).

Each step's CPU time at 5,000 batches is compared with its time at 500: a linear step takes ~10x, a step that is
quadratic in batches or samples ~100x; the bound, 30x, leaves room for a shared machine's noise."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from support.synthetic import synthetic_plan

from hsextract.output.finalize import job_manifest, load_job_files
from hsextract.output.manifest import SAMPLE_INDEX, write_manifest
from hsextract.output.reader import open_output
from hsextract.output.records import (
    RunInfo,
    claim_output,
    job_record,
    publish_job_files,
    sample_ids_checksum,
    write_done,
)
from hsextract.output.sample_index import SampleTable, checksum
from hsextract.prepare.plan import make_plan
from hsextract.run.launcher import finish_output
from hsextract.status.rows import output_status
from hsextract.storage.local import LocalSink
from hsextract.training import StatesDataset

pytestmark = pytest.mark.slow  # a minute: 11,000 batches' job files and records are written first

SMALL, LARGE = 500, 5000
BOUND = 30


LENGTHS: dict[str, list[int]] = {}

"""Each metadata output's sample lengths, for planning them again."""


def metadata_output(root, batches: int, *, done: bool) -> LocalSink:
    """An output's metadata for a synthetic plan of ``batches`` batches: with ``done``, every batch recorded
    complete and the manifest and index written; else the job files alone (every batch still to do)."""
    plan, lengths, ids = synthetic_plan(batches, samples_per_batch=10)
    plan_hash = plan.plan_hash  # a hash of the whole plan: once, not per batch
    sink = LocalSink(root)
    LENGTHS[str(root)] = lengths
    samples = json.dumps(ids).encode()  # the job files as preparation publishes them, each proving itself
    info = RunInfo(
        layer_ids=(0, 1),
        layer_types=("full_attention",) * 2,
        num_layers=2,
        hidden_size=4,
        pad_token_id=0,
        plan_hash=plan_hash,
        file_metadata={},
        sample_ids_sha256=sample_ids_checksum(samples),
    ).to_json()
    claim_output(sink, job_record(plan=plan, nodes=2, run_dir="synthetic", host="synthetic"))
    publish_job_files(sink, {"plan": plan.to_json(), "info": info, "samples": samples, "data_report": {}})
    if not done:
        return sink
    stored = {
        b.key: {"size": 1, "crc32": "00000000", "header_size": 8, "header_xxh3": "0" * 16}
        for b in plan.batches
    }
    for b in plan.batches:
        write_done(sink, {"key": b.key, **stored[b.key]}, plan_hash)
    manifest = job_manifest(load_job_files(sink), stored)
    files = [
        ([ids[i] for i in b.sample_indices], np.cumsum([0] + [lengths[i] for i in b.sample_indices]).tolist())
        for b in plan.batches
    ]
    data = SampleTable.from_files([b.key for b in plan.batches], files, token_bytes=16).encode()
    sink.put_bytes(SAMPLE_INDEX, data)
    manifest["sample_index"] = {"key": SAMPLE_INDEX, "size": len(data), "xxh3": checksum(data)}
    write_manifest(sink, manifest)
    return sink


def cpu_seconds(step) -> float:
    """The least CPU time of this process over three runs of ``step``."""
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        step()
        best = min(best, time.process_time() - t)
    return best


def dataset_order(root) -> None:
    data = StatesDataset(root, "raw", rank=0, world_size=8)
    assert len(data.rank_sequence()) == len(data)


STEPS = {
    "planning the samples": (
        False,
        lambda sink: make_plan(LENGTHS[str(sink.root)], max_tokens_per_batch=64, max_rows=10, shards=8),
    ),
    "finalize with every batch to do": (
        False,
        lambda sink: finish_output(sink, echo=lambda line: None),
    ),
    "status": (True, output_status),
    "open_output": (True, lambda sink: len(open_output(str(sink.root)).manifest["batches"])),
    "StatesDataset and its epoch order": (True, lambda sink: dataset_order(sink.root)),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """``outputs(batches, done)``: the metadata output of that size, made once for every step."""
    made: dict = {}

    def get(batches: int, done: bool) -> LocalSink:
        if (batches, done) not in made:
            with pytest.MonkeyPatch.context() as setup:
                setup.setattr(os, "fsync", lambda fd: None)  # 10,000 small files: durability is not measured
                root = tmp_path_factory.mktemp(f"b{batches}")
                made[batches, done] = metadata_output(root, batches, done=done)
        return made[batches, done]

    return get


@pytest.mark.parametrize("name", list(STEPS))
def test_no_metadata_step_grows_faster_than_the_batch_count(outputs, name):
    done, step = STEPS[name]
    seconds = {}
    for batches in (SMALL, LARGE):
        sink = outputs(batches, done)
        step(sink)  # warm: imports, first-use caches
        seconds[batches] = cpu_seconds(lambda sink=sink: step(sink))
    ratio = seconds[LARGE] / max(seconds[SMALL], 0.002)
    assert ratio < BOUND, (
        f"{name}: {seconds[SMALL]:.3f} s at {SMALL} batches, {seconds[LARGE]:.3f} s at {LARGE}"
    )
