"""model/config_record.py: a rerun reads the recorded config, with the values transformers gives, or none."""

from __future__ import annotations

import json

import pytest

from hsextract.model import config_record
from hsextract.model.config_record import FIELDS, recorded_model_config
from hsextract.model.load import load_model_config
from hsextract.model.target_topk import check_target_topk
from hsextract.validation import seal


def test_the_record_holds_what_transformers_reads_and_a_rerun_uses_it(tmp_path, tiny_model, monkeypatch):
    cache = tmp_path / "cache"
    config, text, num_layers = recorded_model_config(str(tiny_model), cache)
    _, want, want_layers = load_model_config(str(tiny_model))
    (record,) = cache.glob("model-config-*.json")
    assert set(json.loads(record.read_text())["fields"]) == set(FIELDS)

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


def resealed(change):
    """A record whose fields are edited by ``change`` and sealed again: it proves itself, but not as this model's."""
    return lambda r: json.dumps(seal({**r, "fields": change(dict(r["fields"]))}))


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: "not json{",
        lambda r: json.dumps({**r, "fields": {**r["fields"], "num_hidden_layers": 9}}),  # not sealed again
        resealed(lambda f: {**f, "num_hidden_layers": "8"}),
        resealed(lambda f: {**f, "layer_types": f["layer_types"][:3]}),
        resealed(lambda f: {**f, "from_the_future": 1}),
        resealed(lambda f: {**f, "hidden_size": True}),
        resealed(lambda f: {**f, "logit_scale": float("nan")}),
        # Right-typed edits the config file contradicts: the file's own values win.
        resealed(
            lambda f: {**f, "num_hidden_layers": 9, "layer_types": f["layer_types"] + f["layer_types"][:1]}
        ),
        resealed(lambda f: {**f, "vocab_size": 10**6}),
        resealed(lambda f: {**f, "vocab_size": 100}),
        resealed(lambda f: {**f, "hidden_size": 96}),
        lambda r: json.dumps(seal({**r, "config_sha256": "0" * 64})),
    ],
    ids=[
        "garbage",
        "edited",
        "wrong-type",
        "short-layer-types",
        "unknown-key",
        "bool",
        "nan",
        "layers-9",
        "vocab-1e6",
        "vocab-100",
        "hidden",
        "other-hash",
    ],
)
def test_a_damaged_or_edited_record_is_read_again_through_transformers(tmp_path, tiny_model, damage):
    cache = tmp_path / "cache"
    recorded_model_config(str(tiny_model), cache)
    (record,) = cache.glob("model-config-*.json")
    record.write_text(damage(json.loads(record.read_text())))
    _, text, num_layers = recorded_model_config(str(tiny_model), cache)
    assert type(text).__name__ != "ConfigView" and num_layers == 8
    assert json.loads(record.read_text())["fields"]["num_hidden_layers"] == 8  # recorded again
    check_target_topk(text.vocab_size, text)  # a valid K is never refused on a damaged record's word
    _, again, _ = recorded_model_config(str(tiny_model), cache)
    assert type(again).__name__ == "ConfigView" and again.vocab_size == text.vocab_size


def test_another_models_record_never_serves_this_models_config(tmp_path, tiny_model):
    import shutil

    other = shutil.copytree(tiny_model, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 4, config["layer_types"][:4]
    (other / "config.json").write_text(json.dumps(config))
    same = shutil.copytree(tiny_model, tmp_path / "same")  # the same bytes at another path
    cache = tmp_path / "cache"
    recorded_model_config(str(other), cache)
    recorded_model_config(str(same), cache)
    theirs = cache / f"model-config-{config_record._key(str(other))}.json"
    same_bytes = cache / f"model-config-{config_record._key(str(same))}.json"
    mine = cache / f"model-config-{config_record._key(str(tiny_model))}.json"
    for copied in (theirs, same_bytes):
        mine.write_bytes(copied.read_bytes())  # another model's, or the same file's at another path
        _, text, num_layers = recorded_model_config(str(tiny_model), cache)
        assert type(text).__name__ != "ConfigView" and num_layers == 8
        assert json.loads(mine.read_text())["config_file"] == str((tiny_model / "config.json").resolve())


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
