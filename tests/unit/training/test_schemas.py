"""Which layers each trainer schema reads from an output: its own preset of a union, what it is told, or all."""

import re

import pytest
import torch

from hsextract.errors import HsextractError
from hsextract.training.schemas import SCHEMAS, NemoDSpark

UNION = {
    "layer_ids": [1, 5, 16, 19, 31, 33, 46, 47, 60, 61],
    "presets": {"dflash": [1, 16, 31, 46, 61], "dflash2": [5, 19, 33, 47, 61], "eagle3": [1, 31, 60]},
    "final_state": {"slot": 10, "layer": 63},
}


@pytest.mark.parametrize(
    "schema, preset",
    [("specforge-dflash", "dflash"), ("specforge-dflash2", "dflash2"), ("specforge-eagle3", "eagle3")],
)
def test_each_schema_reads_its_own_preset_of_a_union(schema, preset):
    assert SCHEMAS[schema].layers_for(UNION, None) == preset
    assert SCHEMAS[schema].layers_for(UNION, [5, 1]) == [5, 1]  # what it is told wins


def test_a_schema_without_its_preset_in_a_union_asks_which_layers():
    with pytest.raises(HsextractError, match="say which ones specforge-dspark reads: --layers dflash on"):
        SCHEMAS["specforge-dspark"].layers_for(UNION, None)
    with pytest.raises(
        HsextractError, match="say which ones speculators reads: .* layers='dflash' in Python"
    ):
        SCHEMAS["speculators"].layers_for(UNION, None)
    assert SCHEMAS["raw"].layers_for(UNION, None) is None  # the reader's dict: every captured layer


def test_an_output_of_one_preset_or_explicit_ids_serves_every_captured_layer():
    one = {"layer_ids": [1, 31, 60], "presets": {"eagle3": [1, 31, 60]}}
    assert SCHEMAS["specforge-dflash"].layers_for(one, None) is None
    assert SCHEMAS["specforge-eagle3"].layers_for({"layer_ids": [1, 2, 3]}, None) is None


def test_eagle3_checks_the_layers_it_is_served_not_the_union():
    SCHEMAS["specforge-eagle3"].check(UNION, (1, 31, 60))
    with pytest.raises(HsextractError, match="exactly 3"):
        SCHEMAS["specforge-eagle3"].check(UNION)


def test_nemo_dspark_item_pads_to_the_cache_length_and_leaves_longer_samples_out():
    s = {
        "input_ids": torch.tensor([3, 4, 5]),
        "loss_mask": torch.tensor([False, True, True]),
        "hidden_states": torch.ones(3, 10),
        "final_hidden_state": torch.full((3, 2), 2.0),
    }
    schema = NemoDSpark(seq_length=5)
    item = schema.served(s)
    assert item["input_ids"].tolist() == [3, 4, 5, 0, 0] and item["input_ids"].dtype == torch.long
    assert item["loss_mask"].tolist() == [0, 1, 1, 0, 0]
    assert item["target_hidden_states"].shape == (5, 10) and not item["target_hidden_states"][3:].any()
    assert torch.equal(item["target_last_hidden_states"][:3], s["final_hidden_state"])
    assert schema.skip_reason(torch.arange(6), torch.ones(6)) == "longer than the cache's seq_length 5"
    assert schema.skip_reason(torch.arange(5), torch.ones(5)) is None


def test_specforge_items_name_their_sample_so_a_batch_can_be_logged_and_the_export_record_does_not(
    written_output,
):
    """`StatesDataset(output, "specforge-dflash")` through a DataLoader with pad_collate: each batch says which
    samples it holds (`batch["sample_id"]`, a list), each the sample whose tokens are in that row (against the
    reader); the record `hsextract export` writes stays SpecForge's file, without it."""
    from torch.utils.data import DataLoader

    from hsextract.output import open_output
    from hsextract.training import StatesDataset, pad_collate

    out = open_output(written_output)
    data = StatesDataset(written_output, "specforge-dflash", rank=0, world_size=1, seed=1, batch_size=4)
    seen = []
    for batch in DataLoader(data, batch_size=4, collate_fn=pad_collate):
        assert isinstance(batch["sample_id"], list) and len(batch["sample_id"]) == len(batch["input_ids"])
        for row, sid in enumerate(batch["sample_id"]):
            ids = out[sid]["input_ids"]
            assert torch.equal(batch["input_ids"][row, : len(ids)], ids.long()), sid
        seen += batch["sample_id"]
    assert sorted(seen) == sorted(data.sample_ids) and len(set(seen)) == len(seen)
    s = out[seen[0]]
    assert "sample_id" not in SCHEMAS["specforge-dflash"].record(s)
    assert SCHEMAS["specforge-eagle3"].item({}, s) == {"sample_id": seen[0]}


def test_what_a_layer_choice_serves_is_what_the_export_accepts():
    from hsextract.training.schemas import served_by, served_lines

    dflash = {"dflash": [1, 16, 31, 46, 61]}
    served = served_by([1, 16, 31, 46, 61], False, dflash)
    assert [n for n, p in served.items() if p is None] == ["specforge-dflash", "specforge-dflash2"]
    assert "--final-state" in served["speculators"] and "--final-state" in served["modelopt"]
    assert "exactly 3 captured layers" in served["specforge-eagle3"]
    lines = served_lines(served)
    assert lines[0].startswith("serves: specforge-dflash, specforge-dflash2")
    assert any(line.startswith("does not serve specforge-dspark, speculators, modelopt") for line in lines)
    assert all(p is None for p in served_by(UNION["layer_ids"], True, UNION["presets"]).values())
    # The export's refusal asks the same rule: an output of that capture is refused exactly where it says so.
    captures = [(False, [1, 16, 31, 46, 61], dflash), (True, [1, 31, 60], {})]
    for final_state, ids, presets in [*captures, (True, UNION["layer_ids"], UNION["presets"])]:
        manifest = {"layer_ids": ids, "presets": presets, "final_state": {"slot": 0} if final_state else None}
        for name, problem in served_by(ids, final_state, presets).items():
            served_ids = presets.get(SCHEMAS[name].preset) or ids
            if problem is None:
                SCHEMAS[name].check(manifest, served_ids)
            else:
                with pytest.raises(HsextractError, match=re.escape(problem)):
                    SCHEMAS[name].check(manifest, served_ids)
