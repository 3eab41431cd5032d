"""The sample index a finished output carries (output/sample_index.py), on synthetic outputs written as a run writes
them (support/synthetic.py): a trainer indexes the output with one read of it, the index crosses into DataLoader
workers as a path to the same mapped file, a damaged index is refused naming it, and an output written before the
index existed is indexed from its batch files exactly as before."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file
from support.synthetic import make_output

from hsextract.container import map_file
from hsextract.errors import CorruptOutputError
from hsextract.output import SampleTable, verify_output
from hsextract.output.manifest import MANIFEST, SAMPLE_INDEX
from hsextract.output.sample_index import checksum
from hsextract.training import StatesMapDataset

pytestmark = pytest.mark.usefixtures("aws_test_env")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic") / "out"
    return root, make_output(str(root), 12, samples_per_batch=20)


def without_index(root, dest):
    """The output as an hsextract without the sample index wrote it: no file, no manifest entry."""
    shutil.copytree(root, dest)
    (dest / SAMPLE_INDEX).unlink()
    manifest = json.loads((dest / MANIFEST).read_text())
    del manifest["sample_index"]
    (dest / MANIFEST).write_text(json.dumps(manifest))
    return dest


def described(data: StatesMapDataset) -> dict:
    index = data.index
    return {
        "ids": list(data.sample_ids),
        "lengths": data.lengths,
        "where": [index.where_in_file(i) for i in range(len(index))],
        "files": {k: list(r) for k, r in index.file_samples.items()},
        "skipped": index.skipped,
    }


@pytest.mark.parametrize("schema", ["raw", "specforge-dflash"])
def test_an_output_without_the_index_is_indexed_from_its_files_to_the_same_samples(
    synthetic, tmp_path, caplog, schema
):
    root, made = synthetic
    old = without_index(root, tmp_path / "old")
    with caplog.at_level(logging.INFO, logger="hsextract.training.index"):
        before = StatesMapDataset(old, schema)
    assert f"has no {SAMPLE_INDEX}" in caplog.text
    after = StatesMapDataset(root, schema)
    assert after.index.path is not None and before.index.path is None
    standard = load_file(root / SAMPLE_INDEX)  # a standard safetensors file, readable by the library
    assert standard["length"].tolist() == [made["lengths"][i] for i in range(len(made["lengths"]))]
    assert described(after) == described(before)
    # Against the plan the output was written from, independently of either index.
    served = [
        i for i, sid in enumerate(made["sample_ids"]) if schema == "raw" or sid not in before.index.skipped
    ]
    assert list(after.sample_ids) == [made["sample_ids"][i] for i in served]
    assert after.lengths == [made["lengths"][i] for i in served]
    if schema == "specforge-dflash":  # every tenth sample has one loss token, every tenth none (synthetic.py)
        assert 0 < len(after.index.skipped) < len(made["sample_ids"]) // 4
    for i in (0, len(after) // 2, len(after) - 1):
        a, b = after.record(i), before.record(i)
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a if hasattr(a[k], "shape"))


def test_the_dataset_pickles_small_and_its_copy_maps_the_same_file(synthetic, tmp_path):
    root, _ = synthetic
    many = tmp_path / "many"
    make_output(str(many), 12, samples_per_batch=400)  # 20x the samples in as many files
    sizes = []
    for out in (root, many):
        data = StatesMapDataset(out, "specforge-dflash")
        blob = pickle.dumps(data)
        sizes.append(len(blob))
        copy = pickle.loads(blob)
        assert copy.index.path == data.index.path
        assert copy.index.table.ids.base is not None  # a view into the mapped file, not a copy of it
        assert described(copy) == described(data)
        assert copy[len(copy) - 1]["input_ids"].tolist() == data[len(data) - 1]["input_ids"].tolist()
    # What crosses into a worker does not grow with the samples (the manifest's sample ids stay behind).
    assert abs(sizes[1] - sizes[0]) < 2_000, sizes


def test_a_damaged_index_is_refused_naming_it_and_verify_reports_it(synthetic, tmp_path):
    root, _ = synthetic
    out = tmp_path / "out"
    shutil.copytree(root, out)
    path = out / SAMPLE_INDEX
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # in the sample ids, the last array: still a well-formed file
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptOutputError) as caught:
        StatesMapDataset(out, "raw")
    assert caught.value.key == SAMPLE_INDEX and "does not match its checksum" in caught.value.problem
    report = verify_output(str(out), show_progress=False)
    assert [e.key for e in report.bad] == [SAMPLE_INDEX]
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(CorruptOutputError, match=f"{SAMPLE_INDEX}: has 100 bytes"):
        StatesMapDataset(out, "raw")


def test_an_index_rewritten_with_its_checksum_still_has_to_agree_with_the_manifest(synthetic, tmp_path):
    root, _ = synthetic
    out = tmp_path / "out"
    shutil.copytree(root, out)
    table = SampleTable.decode(map_file(str(out / SAMPLE_INDEX)), ValueError)
    first = int(table.file_first[3])  # swap the first two sample ids of file 3 (ids of equal length)
    lo, mid, hi = (int(table.id_offsets[first + k]) for k in range(3))
    ids = table.ids.copy()
    ids[lo:hi] = np.concatenate([table.ids[mid:hi], table.ids[lo:mid]])
    data = dataclasses.replace(table, ids=ids).encode()
    (out / SAMPLE_INDEX).write_bytes(data)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["sample_index"].update(size=len(data), xxh3=checksum(data))
    (out / MANIFEST).write_text(json.dumps(manifest))
    problems = {e.key: e.problem for e in verify_output(str(out), show_progress=False).bad}
    assert list(problems) == [SAMPLE_INDEX]
    assert "lists other samples for shard-00003/batch-000003.safetensors" in problems[SAMPLE_INDEX]
    with pytest.raises(CorruptOutputError, match="holds other samples than the manifest lists"):
        data = StatesMapDataset(out, "raw")
        data[first]  # the file's header is checked against the index's ids when it is opened


def gets_of(requests) -> list[str]:
    """The paths of the GETs among the server's ``(method, path)`` (its log colours ranged ones: 206)."""
    return [path for method, path in requests if re.sub(r"\x1b\[[0-9;]*m", "", method) == "GET"]


@pytest.mark.slow  # 3-6 s: the fast tier's budget (60 s on 2 cores)
def test_training_indexes_an_s3_output_in_a_few_requests_whatever_its_batch_count(s3, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    make_output(url, 12, endpoint_url=s3.url, samples_per_batch=20)
    with s3.requests() as seen:
        data = StatesMapDataset(url, "specforge-dflash", endpoint_url=s3.url)
    gets = gets_of(seen)
    assert len(gets) <= 3, seen  # the manifest and the index
    assert any(path.endswith(SAMPLE_INDEX) for path in gets)
    assert data[0]["input_ids"].numel() >= 2
    # Before the index: two reads of each of the 12 batch files.
    client = s3.client()
    client.delete_object(Bucket=s3_bucket, Key=f"run/{SAMPLE_INDEX}")
    manifest = json.loads(s3.get_object(s3_bucket, f"run/{MANIFEST}"))
    del manifest["sample_index"]
    client.put_object(Bucket=s3_bucket, Key=f"run/{MANIFEST}", Body=json.dumps(manifest).encode())
    with s3.requests() as seen:
        old = StatesMapDataset(url, "specforge-dflash", endpoint_url=s3.url)
    assert len(gets_of(seen)) >= 2 * 12, seen
    assert list(old.sample_ids) == list(data.sample_ids)
