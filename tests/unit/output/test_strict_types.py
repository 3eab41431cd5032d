"""Strict types where values are read (#43): layer ids given to a reader or a trainer's dataset are ints or a
preset's name, never a float served as its floor or a bool as 0 or 1; the manifest's figures are ints of their
range, and its dtypes and sizes are the files' own."""

import json

import pytest
import torch
from support.damage import copy_output

from hsextract.errors import CorruptOutputError, HsextractError
from hsextract.output import open_output, verify_output
from hsextract.output.manifest import MANIFEST
from hsextract.training import StatesDataset


@pytest.mark.parametrize("layers", [[4.7], [1.0], [False], [True], ["1"], [None], 3])
def test_a_layer_id_that_is_not_an_int_is_refused_by_the_reader_and_the_dataset(written_output, layers):
    with pytest.raises(HsextractError, match=r"layers=.*(not a layer id|neither layer ids)"):
        open_output(str(written_output), layers=layers)
    with pytest.raises(HsextractError, match=r"layers=.*(not a layer id|neither layer ids)"):
        StatesDataset(str(written_output), "raw", layers=layers, dtype=torch.float32)


def test_ids_as_ints_or_a_string_of_ids_are_served_in_the_order_asked(written_output):
    out = open_output(str(written_output), layers=[3, 0])
    assert out.layer_ids == (3, 0)
    assert open_output(str(written_output), layers=" 1, 3").layer_ids == (1, 3)


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("hidden_size", "64", "hidden_size '64', not an int"),
        ("num_samples", float("nan"), "num_samples nan, not an int"),
        ("num_tokens", -5, "num_tokens -5, not an int of at least 0"),
        ("vocab_size", True, "vocab_size True, not an int"),
        ("layer_types", ["x"], "layer_types"),
        ("dtype", "bfloat16", "its header says dtype float32, the manifest bfloat16"),
        ("storage_dtype", "float8_e4m3fn", "its header says storage_dtype , the manifest float8_e4m3fn"),
        ("hidden_size", 128, "its header says hidden_size 64, the manifest 128"),
    ],
)
def test_a_manifest_field_of_the_wrong_type_or_other_than_the_files_fails_verify(
    written_output, tmp_path, field, value, says
):
    out = copy_output(written_output, tmp_path / "out")
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, field: value}))
    try:
        report = verify_output(str(out), show_progress=False)
    except CorruptOutputError as e:
        assert says in str(e) and MANIFEST in str(e), str(e)
    else:
        assert not report.ok and says in report.bad[0].problem, report.as_dict()
