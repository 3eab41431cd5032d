"""``StagingWriter`` (run/writer.py): the batch file into staging, within the budget, to the uploader."""

from __future__ import annotations

import json
import time
import zlib

import torch


def _batch_tensors(n: int = 5) -> dict:
    return {
        "hidden_states": torch.randn(n, 2, 8),
        "input_ids": torch.arange(n, dtype=torch.int32),
        "loss_mask": torch.ones(n, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, n], dtype=torch.int64),
        "sample_index": torch.tensor([0], dtype=torch.int64),
    }


class _Submitted(list):
    """Stands in for the uploader process: what the staging writer hands over."""

    def submit(self, path, key, crc32):
        self.append((path, key, crc32))


def test_staging_writer_writes_the_batch_file_and_hands_it_to_the_uploader(tmp_path):
    import threading

    from hsextract.output import BatchSpec, read_metadata
    from hsextract.run.writer import StagingWriter

    uploads = _Submitted()
    writer = StagingWriter(
        tmp_path, 10**9, uploads, file_metadata={"plan_hash": "p"}, sample_ids=["s0"], stop=threading.Event()
    )
    batch = BatchSpec(batch_id=3, shard=0, sample_indices=(0,), padded_length=5, num_tokens=5)
    writer(batch, _batch_tensors())
    path = tmp_path / "batch-000003.safetensors"
    assert uploads == [(path, batch.key, zlib.crc32(path.read_bytes()))]
    assert writer.submitted == {batch.key} and writer.written_at is not None and not writer.waiting
    meta = read_metadata(path)
    assert (meta["plan_hash"], meta["batch_id"], json.loads(meta["sample_ids"])) == ("p", "3", ["s0"])


def test_staging_writer_waits_while_staging_is_over_budget_until_it_drains_or_is_stopped(tmp_path):
    """Bounded staging: a batch that would pass the budget waits for the uploader to drain staging (the
    pipeline's slots, then the GPU, wait with it); a stop ends the wait without writing."""
    import threading

    import pytest

    from hsextract.output import BatchSpec
    from hsextract.run.procs import Stopped
    from hsextract.run.writer import StagingWriter

    staged = tmp_path / "batch-000000.safetensors"
    staged.write_bytes(bytes(4000))  # a file the uploader has not taken yet
    uploads, stop = _Submitted(), threading.Event()
    writer = StagingWriter(
        tmp_path, 4200, uploads, file_metadata={}, sample_ids=["s0"], stop=stop
    )  # 4000 + 369
    batch = BatchSpec(batch_id=1, shard=0, sample_indices=(0,), padded_length=5, num_tokens=5)

    drained_at = []
    drained = threading.Timer(0.3, lambda: (drained_at.append(time.time()), staged.unlink()))
    drained.start()
    writer(batch, _batch_tensors())
    drained.join()
    assert [key for _, key, _ in uploads] == [batch.key]
    assert writer.written_at >= drained_at[0], "written only once staging drained"

    writer = StagingWriter(tmp_path, 100, uploads, file_metadata={}, sample_ids=["s0"], stop=stop)
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(Stopped):
        writer(
            BatchSpec(batch_id=2, shard=0, sample_indices=(0,), padded_length=5, num_tokens=5),
            _batch_tensors(),
        )
    assert writer.waiting and len(uploads) == 1
    assert not (tmp_path / "batch-000002.safetensors").exists()
