"""Finishing an output from the output alone (output/finalize.py via run/launcher.py ``finish_output``, output/manifest.py
``build_manifest``): the manifest lists every planned batch as its file is, in plan order, and is the same
bytes each time it is built; a batch not done or not sound withdraws the manifest, and a damaged one loses its
record."""

import json
import zlib

from safetensors import safe_open
from support.damage import copy_output, flip_in_states

from hsextract.output import Plan
from hsextract.output.records import done_key
from hsextract.run.launcher import finish_output
from hsextract.storage.local import LocalSink


def finalize(out):
    said = []
    code, todo = finish_output(LocalSink(out), echo=said.append)
    return code, todo, said


def test_the_manifest_lists_every_batch_as_its_file_is_and_is_rebuilt_byte_for_byte(written_output, tmp_path):
    out = copy_output(written_output, tmp_path / "out")
    before = (out / "manifest.json").read_bytes()
    manifest = json.loads(before)
    plan = Plan.from_json(json.loads((out / "hsextract" / "plan.json").read_text()))
    assert [b["key"] for b in manifest["batches"]] == [b.key for b in plan.batches]
    for entry in manifest["batches"]:  # against the files themselves, not the records
        data = (out / entry["key"]).read_bytes()
        assert (entry["size"], entry["crc32"]) == (len(data), f"{zlib.crc32(data):08x}")
        with safe_open(out / entry["key"], "pt") as f:
            assert json.loads(f.metadata()["sample_ids"]) == entry["sample_ids"]
    assert manifest["num_samples"] == sum(len(b["sample_ids"]) for b in manifest["batches"])

    (out / "manifest.json").unlink()
    code, todo, said = finalize(out)
    assert (code, todo) == (0, set()) and said[-1].startswith(f"done: {manifest['num_samples']} samples")
    assert (out / "manifest.json").read_bytes() == before


def test_a_batch_without_its_record_withdraws_the_manifest_and_is_left_to_do(written_output, tmp_path):
    out = copy_output(written_output, tmp_path / "out")
    key = json.loads((out / "manifest.json").read_text())["batches"][-1]["key"]
    (out / done_key(key)).unlink()
    code, todo, said = finalize(out)
    assert (code, todo) == (0, {key})  # another node's or a crashed shard's batch: not a failure
    assert not (out / "manifest.json").exists()
    assert said[-1].startswith("1 of 16 batches still to do (shards [1])"), said


def test_a_damaged_batch_loses_its_record_so_that_its_shard_recomputes_it(written_output, tmp_path):
    out = copy_output(written_output, tmp_path / "out")
    key = json.loads((out / "manifest.json").read_text())["batches"][2]["key"]
    flip_in_states(out / key)
    code, todo, said = finalize(out)
    assert (code, todo) == (1, {key})
    assert not (out / "manifest.json").exists() and not (out / done_key(key)).exists()
    assert any(line.startswith(f"output check: {key}: batch file CRC32 ") for line in said), said
