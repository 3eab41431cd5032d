"""An output written by an earlier hsextract (tests/data/README.md says which and how) is read, verified and trained
from as it is: the rows it was made from, and the states that version's reader returned."""

import json
from pathlib import Path

import pytest
import torch

from hsextract.output import open_output, verify_output
from hsextract.training import StatesMapDataset

DATA = Path(__file__).parents[2] / "data"

OUTPUTS = ["output-0.1.0"]


def rows(name: str) -> dict[str, dict]:
    lines = (DATA / f"{name}.data.jsonl").read_text().splitlines()
    return {row["id"]: row for row in map(json.loads, lines)}


@pytest.mark.parametrize("name", OUTPUTS)
def test_an_older_output_reads_back_its_rows_and_the_states_its_own_reader_returned(name):
    out = open_output(str(DATA / name), dtype=torch.float32)
    expected = json.loads((DATA / f"{name}.expected.json").read_text())
    source = rows(name)
    assert sorted(out.sample_ids()) == sorted(source) == sorted(expected)
    for sample_id, sums in expected.items():
        sample = out[sample_id]
        assert sample["input_ids"].tolist() == source[sample_id]["input_ids"]
        assert sample["loss_mask"].tolist() == source[sample_id]["loss_mask"]
        for key, (total, magnitude) in sums.items():
            assert float(sample[key].sum()) == pytest.approx(total, abs=1e-3), (sample_id, key)
            assert float(sample[key].abs().sum()) == pytest.approx(magnitude, abs=1e-3), (sample_id, key)


@pytest.mark.parametrize("name", OUTPUTS)
def test_an_older_output_verifies_whole(name):
    report = verify_output(str(DATA / name), show_progress=False)
    manifest = json.loads((DATA / name / "manifest.json").read_text())
    assert report.ok, report.as_dict()
    # Every batch file, the sample index and the final norm.
    assert report.files == len(manifest["batches"]) + 2


@pytest.mark.parametrize("name", OUTPUTS)
def test_an_older_output_serves_a_trainer_through_its_sample_index(name):
    data = StatesMapDataset(str(DATA / name), "raw", dtype=torch.float32)
    source = rows(name)
    assert sorted(data.sample_ids) == sorted(source)
    for i in range(len(data)):
        assert data[i]["input_ids"].tolist() == source[data[i]["sample_id"]]["input_ids"]
