"""The reader against real damage to a real output (conftest.written_output, copied before each damage).

Whatever is wrong, the reader raises one error type, ``CorruptOutputError``, naming the file and the problem:
never struct.error, JSONDecodeError, MemoryError, KeyError or ValueError. Verifying (the default), it refuses a
sample whose bytes were altered and still serves the intact samples of the same file; ``verify=False`` skips the
checksums, so the same flips come back as altered values (which proves each flip is real).
"""

import json

import pytest
import torch
from support.damage import (
    DAMAGED_ROW,
    DAMAGES,
    copy_output,
    flip_in_ids,
    flip_in_states,
    manifest_batches,
    manifest_key_outside_output,
    manifest_without_batches,
    truncate_manifest,
)

from hsextract.errors import CorruptOutputError
from hsextract.output.reader import BatchFile, open_output
from hsextract.storage.local import LocalSink


def manifest(out) -> dict:
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture
def output(written_output, tmp_path):
    return copy_output(written_output, tmp_path / "out")


def damaged_file(out):
    """The first batch file with a row after ``DAMAGED_ROW``: its damage leaves an intact sample on each side."""
    entry = next(b for b in manifest_batches(out) if len(b["sample_ids"]) > DAMAGED_ROW + 1)
    return entry, out / entry["key"]


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.name for d in DAMAGES])
def test_damaged_batch_file_raises_one_error_naming_the_file_and_the_problem(output, damage):
    entry, path = damaged_file(output)
    damage.apply(path)
    out = open_output(output)
    with pytest.raises(CorruptOutputError) as caught:
        out[entry["sample_ids"][DAMAGED_ROW]]
    assert str(path) in str(caught.value)
    assert caught.value.key == entry["key"]
    assert damage.reader_says in caught.value.problem, caught.value.problem


@pytest.mark.parametrize(
    "damage",
    [d for d in DAMAGES if d.name not in ("states", "ids", "header")],
    ids=[d.name for d in DAMAGES if d.name not in ("states", "ids", "header")],
)
def test_structural_damage_is_named_without_checksums_or_manifest(output, damage):
    """verify=False and no manifest entry: only the file itself to go by, still one error type naming it."""
    entry, path = damaged_file(output)
    damage.apply(path)
    with pytest.raises(CorruptOutputError) as caught:
        f = BatchFile(LocalSink(output), entry["key"], verify=False)
        f.sample(DAMAGED_ROW, tuple(manifest(output)["layer_ids"]))
    assert str(path) in str(caught.value)
    expected = {
        "truncated": "is truncated: it ends at byte",
        "empty": "is empty",
        "garbled": "has a garbled header (not JSON",
        "huge-header": "over the 100000000-byte cap",
        "header-beyond-file": "is truncated: it ends at byte",
        "no-loss-mask": "lacks the tensor(s) loss_mask",
        "deleted": "does not exist",
    }[damage.name]
    assert expected in caught.value.problem, caught.value.problem


@pytest.mark.parametrize("flip", [flip_in_states, flip_in_ids], ids=["states", "ids"])
def test_a_flipped_sample_is_refused_while_the_rest_of_its_file_reads(output, flip, written_output):
    entry, path = damaged_file(output)
    flip(path)
    damaged_id, intact_id = entry["sample_ids"][DAMAGED_ROW], entry["sample_ids"][0]
    clean = open_output(written_output)
    out = open_output(output)
    assert torch.equal(out[intact_id]["hidden_states"], clean[intact_id]["hidden_states"])
    with pytest.raises(CorruptOutputError, match=f"sample '{damaged_id}' \\(row {DAMAGED_ROW}"):
        out[damaged_id]
    with pytest.raises(CorruptOutputError):  # iteration meets it too
        for _ in out:
            pass
    # Unverified, the flip comes back as an altered value: the damage is real and the checksum is what caught it.
    unchecked = open_output(output, verify=False)[damaged_id]
    name = "hidden_states" if flip is flip_in_states else "input_ids"
    assert not torch.equal(unchecked[name], clean[damaged_id][name])


@pytest.mark.parametrize(
    "damage, says",
    [
        (truncate_manifest, "is not valid JSON"),
        (manifest_without_batches, "has no batch list"),
        (manifest_key_outside_output, "not a path inside the output"),
    ],
    ids=["truncated", "no-batches", "key-outside"],
)
def test_damaged_manifest_raises_the_same_error_naming_it(output, damage, says):
    damage(output)
    with pytest.raises(CorruptOutputError) as caught:
        open_output(output)
    assert caught.value.key == "manifest.json"
    assert str(output / "manifest.json") in str(caught.value)
    assert says in caught.value.problem


def edit_manifest_ids(out, edit) -> dict:
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest["batches"])
    path.write_text(json.dumps(manifest))
    return manifest


def test_a_sample_listed_twice_is_named_with_the_batch_that_lists_it_again(output):
    """Within one batch and across two: the id and the batch named (ids are told apart by hashes first)."""

    def across(batches):
        batches[2]["sample_ids"][1] = batches[0]["sample_ids"][0]

    manifest = edit_manifest_ids(output, across)
    again, key = manifest["batches"][0]["sample_ids"][0], manifest["batches"][2]["key"]
    with pytest.raises(CorruptOutputError, match=f"lists sample '{again}' twice \\(again in {key}\\)"):
        open_output(output)

    def within(batches):
        batches[2]["sample_ids"][1] = batches[0]["sample_ids"][0] + "-"  # unique again
        batches[1]["sample_ids"][-1] = batches[1]["sample_ids"][0]

    manifest = edit_manifest_ids(output, within)
    again, key = manifest["batches"][1]["sample_ids"][0], manifest["batches"][1]["key"]
    with pytest.raises(CorruptOutputError, match=f"lists sample '{again}' twice \\(again in {key}\\)"):
        open_output(output)


class CountingSink:
    """A sink that counts the bytes its ranged reads return (the bytes a reader fetched)."""

    def __init__(self, sink):
        self.sink, self.bytes_read = sink, 0

    def read_range(self, key, offset, length):
        raw = self.sink.read_range(key, offset, length)
        self.bytes_read += len(raw)
        return raw

    def read_range_into(self, key, offset, buffer, on_part=None):
        got = self.sink.read_range_into(key, offset, buffer, on_part)
        self.bytes_read += got
        return got

    def __getattr__(self, name):
        return getattr(self.sink, name)


def test_a_layer_subset_is_served_in_the_order_asked_and_equals_the_full_read(written_output):
    out_dir = written_output
    full = open_output(out_dir)
    sub = open_output(out_dir, layers=[3, 0])
    assert sub.layer_ids == (3, 0) and full.layer_ids == (0, 1, 3)
    for sid in full.sample_ids()[:12]:
        a, b = full[sid], sub[sid]
        assert list(b["layers"]) == [3, 0]
        assert torch.equal(b["layers"][3], a["layers"][3]) and torch.equal(b["layers"][0], a["layers"][0])
        assert torch.equal(b["hidden_states"], torch.cat([a["layers"][3], a["layers"][0]], dim=-1))
        assert torch.equal(b["input_ids"], a["input_ids"])
    contiguous = open_output(out_dir, layers="1,3")[full.sample_ids()[0]]
    assert contiguous["hidden_states"].is_contiguous() and list(contiguous["layers"]) == [1, 3]


def test_a_layer_subset_reads_every_stored_slot_of_its_tokens(written_output):
    """The batch files are token-major: a subset saves memory and copies, not bytes read (docs/FORMAT.md)."""
    out_dir = written_output
    counts = {}
    for layers in (None, [3]):
        out = open_output(out_dir, layers=layers)
        samples = [out[sid] for sid in out.sample_ids()]  # opens every file first: headers and held tensors
        out.sink = CountingSink(out.sink)
        out._files.clear()
        delivered = 0
        for sid in out.sample_ids():
            delivered += out[sid]["hidden_states"].numel() * 4  # float32 run
        counts[str(layers)] = (out.sink.bytes_read, delivered)
        assert len(samples) == len(out)
    (read_all, delivered_all), (read_one, delivered_one) = counts["None"], counts["[3]"]
    assert read_one == read_all  # the same ranged reads either way
    assert delivered_one * 3 == delivered_all  # one of the three stored layers delivered


@pytest.mark.parametrize(
    "layers, says",
    [
        ([5], r"\[5\] are not stored"),
        ("dflash", r"\[2, 4, 5\] are not stored"),
        ([3, 3], "at most once"),
        ("eagle", "neither a preset"),
    ],
)
def test_layers_the_output_does_not_store_are_refused_naming_what_it_stores(written_output, layers, says):
    from hsextract.errors import HsextractError

    with pytest.raises(HsextractError, match=says) as caught:
        open_output(written_output, layers=layers)
    assert "[0, 1, 3]" in str(caught.value)


def test_a_key_the_extraction_did_not_store_says_which_option_stores_it(written_output):
    out = open_output(written_output)
    sample = out[out.sample_ids()[0]]
    assert "final_hidden_state" not in sample and sample.get("final_hidden_state") is None
    with pytest.raises(KeyError, match="extracted without --final-state"):
        sample["final_hidden_state"]
    with pytest.raises(KeyError, match="without --target-topk K"):
        sample["target_topk_ids"]
    with pytest.raises(KeyError) as caught:
        sample["no_such_key"]
    assert caught.value.args == ("no_such_key",)  # any other key: the plain KeyError
