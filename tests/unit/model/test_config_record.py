"""model/config_record.py: a rerun reads the recorded config, with the values transformers gives, or none."""

from __future__ import annotations

import json

import pytest

from hsextract.model import config_record
from hsextract.model.config_record import FIELDS, recorded_model_config
from hsextract.model.load import load_model_config


def test_the_record_holds_what_transformers_reads_and_a_rerun_uses_it(tmp_path, tiny_model, monkeypatch):
    cache = tmp_path / "cache"
    config, text, num_layers = recorded_model_config(str(tiny_model), cache)
    _, want, want_layers = load_model_config(str(tiny_model))
    (record,) = cache.glob("model-config-*.json")
    assert set(json.loads(record.read_text())) == set(FIELDS)

    def refuse(model):
        raise AssertionError("read through transformers although recorded")

    monkeypatch.setattr(config_record, "load_model_config", refuse)
    view, view_text, view_layers = recorded_model_config(str(tiny_model), cache)
    assert view_layers == want_layers == num_layers and view.get_text_config() is view_text
    for name in FIELDS:
        assert getattr(view_text, name) == (
            list(getattr(want, name)) if name == "layer_types" else getattr(want, name, None)
        ), name
    assert view_text.layer_types.count("full_attention") == 2  # the tiny qwen3_5's, defaults included


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: "not json{",
        lambda r: json.dumps({**r, "num_hidden_layers": "8"}),
        lambda r: json.dumps({**r, "layer_types": r["layer_types"][:3]}),
        lambda r: json.dumps({**r, "from_the_future": 1}),
        lambda r: json.dumps({**r, "hidden_size": True}),
    ],
    ids=["garbage", "wrong-type", "short-layer-types", "unknown-key", "bool"],
)
def test_a_damaged_record_is_read_again_through_transformers(tmp_path, tiny_model, damage):
    cache = tmp_path / "cache"
    recorded_model_config(str(tiny_model), cache)
    (record,) = cache.glob("model-config-*.json")
    record.write_text(damage(json.loads(record.read_text())))
    _, text, _ = recorded_model_config(str(tiny_model), cache)
    assert type(text).__name__ != "ConfigView"
    assert json.loads(record.read_text())["num_hidden_layers"] == 8  # recorded again


def test_a_changed_config_is_another_record_and_a_hub_id_has_none(tmp_path, tiny_model):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cache = tmp_path / "cache"
    recorded_model_config(str(model), cache)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 4, config["layer_types"][:4]
    (model / "config.json").write_text(json.dumps(config))
    _, _, num_layers = recorded_model_config(str(model), cache)
    assert num_layers == 4 and len(list(cache.glob("model-config-*.json"))) == 2
    assert config_record._key("org/not-a-local-dir") is None
