"""Several samples of one batch file from one ranged read (``BatchFile.samples``), against the file itself.

Files are written by the project's own writer; the reference is ``safetensors`` reading the whole file, sliced by
``cu_seqlens``, fp8 dequantized by the formula of docs/FORMAT.md, the final norm applied by hand: nothing of the
reader's code. A flipped byte inside a run fails that sample alone, naming the file; its neighbours in the same
read are served.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from support import damage

from hsextract.errors import CorruptOutputError
from hsextract.output import batchfile
from hsextract.output.batch import StateLayout, batch_metadata
from hsextract.output.final_norm import FinalNorm
from hsextract.output.fp8 import quantize_fp8
from hsextract.output.reader import BatchFile, SampleView
from hsextract.output.writer import write_batch_file
from hsextract.storage.local import LocalSink

LENGTHS = [7, 1, 12, 5, 30, 3]
HIDDEN = 16


class CountingSink(LocalSink):
    """A local output that counts its reads."""

    reads = 0

    def read_range_into(self, key, offset, buffer, on_part=None):
        self.reads += 1
        return super().read_range_into(key, offset, buffer, on_part)


def write_file(tmp_path, layout: StateLayout) -> str:
    torch.manual_seed(0)
    n, slots = sum(LENGTHS), len(layout.slot_layers)
    states = torch.randn(n, slots, HIDDEN) * torch.rand(n, slots, 1) * 10
    tensors = {
        "input_ids": torch.randint(0, 1000, (n,), dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (n,), dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int64),
        "sample_index": torch.arange(len(LENGTHS), dtype=torch.int64),
    }
    if layout.scaled:
        tensors["hidden_states"], tensors["hidden_states_scale"] = quantize_fp8(states)
    else:
        tensors["hidden_states"] = states.to(torch.bfloat16)
    ids = [f"s{i}" for i in range(len(LENGTHS))]
    meta = batch_metadata(run_meta={}, batch_id=0, shard=0, sample_ids=ids)
    write_batch_file(tmp_path / "batch.safetensors", tensors, meta)
    return "batch.safetensors"


NORM = FinalNorm(weight=torch.linspace(0.5, 1.5, HIDDEN).to(torch.bfloat16), eps=1e-6, rule="weight")
LAYOUTS = {
    "bf16": StateLayout((1, 2, 3), 4),
    "bf16-final-slot": StateLayout((0, 2), 4, final_state=True),  # the final state is an extra, third slot
    "fp8-final-slot": StateLayout((0, 2), 4, final_state=True, storage_dtype="float8_e4m3fn"),
}


def expected(tmp_path, key: str, layout: StateLayout, row: int, dequantize: bool = True) -> dict:
    t = load_file(str(tmp_path / key))
    cu = t["cu_seqlens"].tolist()
    a, b = cu[row], cu[row + 1]
    states = t["hidden_states"][a:b]
    n = len(layout.layer_ids)
    out = {"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b].bool()}
    if layout.scaled:
        scale = t["hidden_states_scale"][a:b]
        values = (states.float() * scale.unsqueeze(-1)).to(torch.bfloat16)
        states = values if dequantize else states
    else:
        values = states
    out["hidden_states"] = states[:, :n].reshape(b - a, -1)
    if layout.final_state:
        x = values[:, layout.final_slot].float()
        normed = x * (x.pow(2).mean(-1, keepdim=True) + NORM.eps).rsqrt()
        out["final_hidden_state"] = NORM.weight * normed.to(torch.bfloat16)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [1, 2, 3], [0, 2, 5]], ids=["all", "run", "gaps"])
def test_a_run_read_at_once_equals_the_file_sample_for_sample(tmp_path, name, rows):
    layout = LAYOUTS[name]
    key = write_file(tmp_path, layout)
    sink = CountingSink(tmp_path)
    f = BatchFile(sink, key)
    opened, sink.reads = sink.reads, 0
    assert opened <= 3  # the header's length, the header, then index tensors, token ids and masks together
    view = SampleView(layout, NORM if layout.final_state else None)
    got = f.samples(rows, view)
    assert sink.reads == 1 and sorted(got) == rows  # one read of states for them all; only the rows asked for
    for row in rows:
        want = expected(tmp_path, key, layout, row)
        for k, v in want.items():
            assert got[row][k].dtype == v.dtype and torch.equal(got[row][k], v), (row, k)
        alone = f.sample(row, view)  # a read of the sample alone gives the same
        assert all(torch.equal(alone[k], got[row][k]) for k in want)
        assert got[row]["sample_id"] == f"s{row}"


class StartingAgainSink(LocalSink):
    """Each read gets half-way with garbage in the buffer, then starts again from the first byte: what S3Sink does
    when a connection drops mid-body (the reader checksums bytes as they arrive and must start over with them)."""

    def read_range_into(self, key, offset, buffer, on_part=None):
        view = memoryview(buffer).cast("B")
        view[: len(view) // 2] = b"\x55" * (len(view) // 2)
        if on_part is not None:
            on_part(0, len(view) // 2)
        return super().read_range_into(key, offset, buffer, on_part)


def test_a_read_that_starts_again_is_checked_on_the_bytes_it_ends_with(tmp_path):
    layout = LAYOUTS["bf16"]
    key = write_file(tmp_path, layout)
    got = BatchFile(StartingAgainSink(tmp_path), key).samples([0, 1, 2, 3, 4, 5], SampleView(layout, None))
    for row in range(len(LENGTHS)):
        assert not isinstance(got[row], CorruptOutputError), got[row]
        assert torch.equal(got[row]["hidden_states"], expected(tmp_path, key, layout, row)["hidden_states"])


def test_with_nothing_held_every_tensor_is_read_per_run_and_checked_the_same(tmp_path, monkeypatch):
    """Per-token tensors wider than ``HELD_ROW_BYTES`` are read with the states, one read each per run."""
    monkeypatch.setattr(batchfile, "HELD_ROW_BYTES", 0)
    layout = LAYOUTS["fp8-final-slot"]
    key = write_file(tmp_path, layout)
    sink = CountingSink(tmp_path)
    f = BatchFile(sink, key)
    sink.reads = 0
    got = f.samples([1, 2, 3], SampleView(layout, NORM))
    assert sink.reads == 4  # states, scales, token ids, loss mask
    for row in (1, 2, 3):
        for k, v in expected(tmp_path, key, layout, row).items():
            assert torch.equal(got[row][k], v), (row, k)
    damage.flip(tmp_path / key, damage.row_offset(tmp_path / key, "loss_mask", 2) + 1, mask=0x01)
    got = BatchFile(LocalSink(tmp_path), key).samples([1, 2, 3], SampleView(layout, NORM))
    assert isinstance(got[2], CorruptOutputError) and "'s2'" in got[2].problem
    assert not isinstance(got[1], CorruptOutputError) and not isinstance(got[3], CorruptOutputError)


def test_fp8_values_as_stored_come_with_their_scales(tmp_path):
    layout = LAYOUTS["fp8-final-slot"]
    key = write_file(tmp_path, layout)
    f = BatchFile(LocalSink(tmp_path), key)
    got = f.samples([2, 3], SampleView(layout, NORM, dequantize=False))
    t = load_file(str(tmp_path / key))
    for row, (a, b) in ((2, (8, 20)), (3, (20, 25))):
        assert torch.equal(got[row]["hidden_states_scale"], t["hidden_states_scale"][a:b, :2])
        stored = got[row]["layers"][2].view(torch.uint8)
        assert torch.equal(stored, t["hidden_states"][a:b, 1].view(torch.uint8))


def test_states_land_in_the_memory_the_caller_gives(tmp_path):
    layout = LAYOUTS["bf16"]
    key = write_file(tmp_path, layout)
    given = []

    def alloc(nbytes):
        given.append(torch.empty(nbytes, dtype=torch.uint8))
        return given[-1]

    got = BatchFile(LocalSink(tmp_path), key).samples([1, 2, 3], SampleView(layout, None), alloc)
    assert len(given) == 1 and given[0].numel() == (1 + 12 + 5) * 3 * HIDDEN * 2
    for row in (1, 2, 3):  # views of that one buffer, no copy
        assert got[row]["hidden_states"].untyped_storage().data_ptr() == given[0].data_ptr()


def test_a_flipped_byte_inside_a_run_fails_that_sample_alone_naming_the_file(tmp_path):
    layout = LAYOUTS["bf16"]
    key = write_file(tmp_path, layout)
    path = tmp_path / key
    clean = BatchFile(LocalSink(tmp_path), key).samples([1, 2, 3], SampleView(layout, None))
    header = int.from_bytes(path.read_bytes()[:8], "little")
    raw = bytearray(path.read_bytes())
    raw[8 + header + (7 + 1 + 5) * 3 * HIDDEN * 2 + 3] ^= 0x10  # inside row 2's states (tokens 8..20)
    path.write_bytes(raw)
    got = BatchFile(LocalSink(tmp_path), key).samples([1, 2, 3], SampleView(layout, None))
    assert isinstance(got[2], CorruptOutputError)
    assert got[2].key == key and str(path) in str(got[2])
    assert "sample 's2' (row 2, tokens 8..20) does not match its checksum" in got[2].problem
    for row in (1, 3):
        assert torch.equal(got[row]["hidden_states"], clean[row]["hidden_states"])
    with pytest.raises(CorruptOutputError, match="'s2'"):
        BatchFile(LocalSink(tmp_path), key).sample(2, SampleView(layout, None))
