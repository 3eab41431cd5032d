"""Batch files and the staging writer (run/writer.py): standard safetensors, byte-identical, checksummed, and
staged within the budget."""

import json
import time
import zlib

import torch
from safetensors import safe_open

from hsextract.format.batch import batch_metadata
from hsextract.run.writer import write_safetensors


def test_batch_file_is_standard_safetensors(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "hidden_states": torch.randn(37, 3, 16).to(torch.bfloat16),
        "input_ids": torch.randint(0, 1000, (37,), dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (37,), dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, 30, 37], dtype=torch.int64),
        "sample_index": torch.tensor([4, 9], dtype=torch.int64),
    }
    meta = batch_metadata(run_meta={"layer_ids": "[1, 2, 3]"}, batch_id=5, shard=1, sample_ids=["a", "b"])
    path = tmp_path / "batch-000005.safetensors"
    size, crc = write_safetensors(path, tensors, meta)
    assert (size, crc) == (path.stat().st_size, zlib.crc32(path.read_bytes()))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file (*.tmp-PID-TID) left
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["batch_id"] == "5"
        assert json.loads(f.metadata()["sample_ids"]) == ["a", "b"]
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t), name


def test_same_inputs_give_byte_identical_files(tmp_path):
    t = {"x": torch.arange(10, dtype=torch.float32)}
    write_safetensors(tmp_path / "a.safetensors", t, {"k": "v"})
    write_safetensors(tmp_path / "b.safetensors", t, {"k": "v"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_checksums_cover_every_per_token_tensor_so_a_flip_in_an_added_one_is_caught(tmp_path):
    """A per-token tensor the writer does not know by name (fp8 scales, say) is covered by the sample checksums."""
    from hsextract.errors import CorruptOutputError
    from hsextract.format.batch import StateLayout
    from hsextract.reader import BatchFile, SampleView
    from hsextract.run.writer import write_batch_file
    from hsextract.storage.local import LocalSink

    torch.manual_seed(0)
    n = 37
    tensors = {
        "sample_index": torch.tensor([4, 9], dtype=torch.int64),
        "scales": torch.rand(n, 3, dtype=torch.float32),
        "hidden_states": torch.randn(n, 3, 16).to(torch.bfloat16),
        "input_ids": torch.randint(0, 1000, (n,), dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (n,), dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, 30, n], dtype=torch.int64),
    }
    meta = batch_metadata(run_meta={}, batch_id=0, shard=0, sample_ids=["a", "b"])
    path = tmp_path / "batch.safetensors"
    write_batch_file(path, tensors, meta)
    with safe_open(str(path), framework="pt") as f:
        checksums = json.loads(f.metadata()["checksums"])
        assert torch.equal(f.get_tensor("scales"), tensors["scales"])
    assert checksums["per_token_tensors"] == ["hidden_states", "input_ids", "loss_mask", "scales"]
    assert checksums["index_tensors"] == ["cu_seqlens", "sample_index"]
    batch = BatchFile(LocalSink(tmp_path), path.name)
    view = SampleView(StateLayout(layer_ids=(1, 2, 3), num_layers=4), final_norm=None)
    assert torch.equal(batch.sample(1, view)["scales"], tensors["scales"][30:])

    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    start = 8 + header_len + json.loads(path.read_bytes()[8 : 8 + header_len])["scales"]["data_offsets"][0]
    raw = bytearray(path.read_bytes())
    raw[start + 30 * 3 * 4 + 1] ^= 0x01  # one bit of sample b's first scale
    path.write_bytes(raw)
    batch = BatchFile(LocalSink(tmp_path), path.name)
    assert torch.equal(batch.sample(0, view)["scales"], tensors["scales"][:30])  # sample a is intact
    try:
        batch.sample(1, view)
    except CorruptOutputError as e:
        assert "sample 'b' (row 1" in str(e) and str(path) in str(e)
    else:
        raise AssertionError("a flipped bit in an added per-token tensor went unnoticed")


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

    from hsextract.prepare.plan import BatchSpec
    from hsextract.run.writer import StagingWriter, read_metadata

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

    from hsextract.prepare.plan import BatchSpec
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
