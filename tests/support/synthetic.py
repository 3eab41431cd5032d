"""A synthetic finished output of any size, written as a run writes one: job files and claim, batch files (real
safetensors with checksums, tiny states), one completion record each, then ``finish_output`` for the manifest.

For the metadata paths at scale (thousands of batch files, ~190 samples each, a few tokens a sample): opening the
output, indexing it for training, status, finalize. The states are small so that 4,800 files take seconds to write;
the loss masks vary so that SpecForge's DFlash schema leaves some samples out.
"""

from __future__ import annotations

import json
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hsextract.container import read_file_head
from hsextract.output import BatchSpec, Plan, StateLayout, batch_metadata, run_file_metadata, write_batch_file
from hsextract.output.ledger import (
    RunInfo,
    claim_output,
    job_record,
    publish_job_files,
    sample_ids_checksum,
    stored_record,
    write_done,
)
from hsextract.run.launcher import finish_output
from hsextract.storage import open_sink

LAYOUT = StateLayout(layer_ids=(0, 1), num_layers=2)
HIDDEN = 4


def synthetic_plan(batches: int, samples_per_batch: int = 190, shards: int = 8, seed: int = 0):
    """A plan of ``batches`` batches (about ``samples_per_batch`` samples each, 2-8 tokens a sample) over
    ``shards`` shards, and every sample's length and id."""
    rng = random.Random(seed)
    specs, lengths, ids = [], [], []
    for b in range(batches):
        n = samples_per_batch + rng.randint(-5, 5)
        first = len(lengths)
        lengths += sorted((rng.randint(2, 8) for _ in range(n)), reverse=True)
        ids += [f"conv-{first + i:07d}" for i in range(n)]
        tokens = sum(lengths[first:])
        specs.append(BatchSpec(b, b % shards, tuple(range(first, first + n)), lengths[first], tokens))
    fingerprint = {"layer_ids": list(LAYOUT.layer_ids), "dtype": "bfloat16", "synthetic": seed}
    return Plan(batches=tuple(specs), shards=shards, fingerprint=fingerprint), lengths, ids


def make_output(
    output: str,
    batches: int,
    *,
    endpoint_url: str | None = None,
    samples_per_batch: int = 190,
    seed: int = 0,
    threads: int = 8,
    finalize: bool = True,
    planned: tuple | None = None,
    layout: StateLayout = LAYOUT,
    hidden: int = HIDDEN,
    full_loss: bool = False,
) -> dict:
    """Write a synthetic output of ``batches`` batch files to ``output`` (a directory or ``s3://bucket/prefix``)
    and finalize it. Returns what a test compares against: ``plan``, ``lengths``, ``sample_ids``, ``masks``.
    ``planned`` (a plan, its samples' lengths and ids), ``layout``, ``hidden`` and ``full_loss`` (every token
    supervised) give the benches outputs of a real target's shape."""
    plan, lengths, ids = planned or synthetic_plan(batches, samples_per_batch, seed=seed)
    plan_hash = plan.plan_hash
    sink = open_sink(output, endpoint_url)
    info = RunInfo(
        layer_ids=layout.layer_ids,
        layer_types=("full_attention",) * len(layout.layer_ids),
        num_layers=layout.num_layers,
        hidden_size=hidden,
        pad_token_id=0,
        plan_hash=plan_hash,
        file_metadata={},
        vocab_size=1000,
        sample_ids_sha256=sample_ids_checksum(json.dumps(ids).encode()),
    )
    claim_output(sink, job_record(plan=plan, nodes=1, run_dir="synthetic", host="synthetic"))
    publish_job_files(
        sink, {"plan": plan.to_json(), "info": info.to_json(), "samples": ids, "data_report": {}}
    )
    run_meta = run_file_metadata(
        layout=layout,
        presets={},
        model="synthetic",
        model_revision="",
        model_config_hash="",
        dtype="bfloat16",
        hidden_size=hidden,
        tokenizer_hash="",
        chat_template_hash="",
        plan_hash=plan_hash,
        kernels="",
    )
    masks: dict[str, list[int]] = {}
    staging = Path(tempfile.mkdtemp(prefix="hsextract-synthetic-"))

    def write(spec: BatchSpec) -> None:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + spec.batch_id)
        lens = [lengths[i] for i in spec.sample_indices]
        n = sum(lens)
        # Sample i of the batch supervises its last 2 tokens, or 0 or 1 for every tenth (DFlash leaves those out).
        loss = lens if full_loss else [{0: 0, 1: 1}.get(i % 10, 2) for i in range(len(lens))]
        mask = torch.cat([torch.tensor([0] * (m - k) + [1] * k) for m, k in zip(lens, loss, strict=True)])
        tensors = {
            "hidden_states": torch.randn(n, len(layout.slot_layers), hidden, generator=gen).to(
                torch.bfloat16
            ),
            "input_ids": torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int32),
            "loss_mask": mask.to(torch.uint8),
            "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64),
            "sample_index": torch.tensor(spec.sample_indices, dtype=torch.int64),
        }
        meta = batch_metadata(
            run_meta=run_meta,
            batch_id=spec.batch_id,
            shard=spec.shard,
            sample_ids=[ids[i] for i in spec.sample_indices],
        )
        path = staging / spec.key
        path.parent.mkdir(parents=True, exist_ok=True)
        _size, crc = write_batch_file(path, tensors, meta)
        stored = sink.put_file(path, spec.key, crc)
        record = stored_record(stored, sink.url, read_file_head(path))
        write_done(sink, record, plan_hash)
        path.unlink()
        masks[spec.key] = mask.tolist()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, plan.batches))
    if finalize:
        code, todo = finish_output(sink, echo=lambda line: None)
        assert code == 0 and not todo, (code, sorted(todo)[:3])
    return {"plan": plan, "lengths": lengths, "sample_ids": ids, "masks": masks}
