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
from hsextract.reader import BatchFile, open_output
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
