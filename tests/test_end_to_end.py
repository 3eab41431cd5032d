"""The whole path, in real processes: data -> plan -> 2 worker shards -> batch files -> reader, checked against an
unbatched HF forward with output_hidden_states (the independent reference)."""

import json

import torch
from conftest import E2E_LAYERS, run_cli
from safetensors import safe_open

from hsextract.reader import open_output

LAYERS = E2E_LAYERS  # conftest.finished_run, shared with the tests that read or damage its output


def test_reader_states_equal_unbatched_hf_forward(finished_run, tiny_lm, tiny_tokenizer):
    root, data, _, _ = finished_run
    out = open_output(root / "out")
    rows = [json.loads(line) for line in open(data)]
    assert len(out) == len(rows)
    assert out.layer_ids == LAYERS
    lengths = []
    for sample in out:
        ids = sample["input_ids"]
        lengths.append(len(ids))
        with torch.inference_mode():
            ref = tiny_lm(ids[None], output_hidden_states=True).hidden_states
        for k in LAYERS[:-1]:
            torch.testing.assert_close(sample["layers"][k], ref[k + 1][0], rtol=1e-4, atol=1e-4)
        # HF's last entry has the final norm applied; ours is the raw output of the last layer.
        last = LAYERS[-1]
        torch.testing.assert_close(
            tiny_lm.model.norm(sample["layers"][last]), ref[last + 1][0], rtol=1e-4, atol=1e-4
        )
        assert sample["hidden_states"].shape == (len(ids), len(LAYERS) * 64)
        torch.testing.assert_close(sample["hidden_states"][:, 64:128], sample["layers"][LAYERS[1]])
    assert min(lengths) == 1 and max(lengths) >= 6 * 34


def test_pretokenized_rows_keep_ids_and_mask_by_sample_id(finished_run):
    root, data, _, _ = finished_run
    out = open_output(root / "out")
    for row in map(json.loads, open(data)):
        if "input_ids" in row:
            s = out[row["id"]]
            assert s["input_ids"].tolist() == row["input_ids"]
            assert s["loss_mask"].int().tolist() == row["loss_mask"]


def test_output_has_several_batches_over_two_shards_and_clean_staging(finished_run):
    root, _, result, _ = finished_run
    files = sorted((root / "out").rglob("*.safetensors"))
    assert {f.parent.name for f in files} == {"shard-00000", "shard-00001"}
    assert len(files) >= 4
    with safe_open(str(files[0]), framework="pt") as f:
        meta = f.metadata()
        assert json.loads(meta["layer_ids"]) == list(LAYERS)
        assert meta["layer_convention"] == "output_of_decoder_layer"
        assert json.loads(meta["hf_output_hidden_states_index"]) == [k + 1 for k in LAYERS]
        assert f.get_slice("hidden_states").get_shape()[1:] == [len(LAYERS), 64]
    assert not any((root / "staging").rglob("*.safetensors"))
    assert "done:" in result.stdout


def test_rerun_of_a_finished_run_recomputes_nothing(finished_run):
    root, _, _, args = finished_run
    before = {p: p.stat().st_mtime_ns for p in (root / "out").rglob("*.safetensors")}
    r = run_cli(*args)
    assert "shards already complete: [0, 1]" in r.stdout
    after = {p: p.stat().st_mtime_ns for p in (root / "out").rglob("*.safetensors")}
    assert before == after
