"""Batch files and the staging writer (run/writer.py): standard safetensors, byte-identical, checksummed, and
staged within the budget."""

import json
import zlib

import torch
from safetensors import safe_open

from hsextract.output.batch import batch_metadata
from hsextract.output.writer import write_safetensors


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
    from hsextract.output.batch import StateLayout
    from hsextract.output.reader import BatchFile, SampleView
    from hsextract.output.writer import write_batch_file
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
