import json

import torch
from safetensors import safe_open

from hsextract.output import batch_metadata
from hsextract.writer import write_safetensors


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
    size = write_safetensors(path, tensors, meta)
    assert size == path.stat().st_size
    assert not list(tmp_path.glob("*.tmp"))
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
