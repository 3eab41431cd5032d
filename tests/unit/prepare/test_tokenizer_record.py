"""prepare/tokenizer_record.py: a launch from the token cache takes the tokenizer's fingerprint and pad id from
the record its files match, without loading it; any change to those files loads the tokenizer again. The reference
is ``tokenizer_fingerprint`` of the tokenizer as ``load_tokenizer`` makes it."""

from __future__ import annotations

import json
import shutil

import pytest

from hsextract.prepare.snapshot_tokenizer import SnapshotTokenizer
from hsextract.prepare.tokenize import load_tokenizer, tokenizer_fingerprint
from hsextract.prepare.tokenizer_record import RecordedTokenizer, files_key


@pytest.fixture
def model(tiny_model, tmp_path):
    """A copy of the tiny model's directory, whose files a test may change."""
    return shutil.copytree(tiny_model, tmp_path / "model")


def reference(model) -> tuple[dict, int]:
    tokenizer = load_tokenizer(str(model))
    return tokenizer_fingerprint(tokenizer), tokenizer.pad_token_id


def test_a_second_launch_answers_from_the_record_without_loading_the_tokenizer(model, tmp_path):
    first = RecordedTokenizer(str(model), tmp_path / "cache")
    assert (first.recorded_fingerprint(), first.pad_token_id) == reference(model)
    assert first.loaded and first.path.is_file()

    second = RecordedTokenizer(str(model), tmp_path / "cache")
    assert (second.recorded_fingerprint(), second.pad_token_id) == reference(model)
    assert not second.loaded
    assert tokenizer_fingerprint(second) == reference(model)[0]  # what the cache key and the plan take
    assert second.load().pad_token_id == second.pad_token_id


@pytest.mark.parametrize(
    "change",
    [
        lambda m: (m / "tokenizer_config.json").write_text(
            json.dumps(
                {**json.loads((m / "tokenizer_config.json").read_text()), "chat_template": "{{ 'x' }}"}
            )
        ),
        lambda m: (m / "added_tokens.json").write_text(json.dumps({"<|extra|>": 999_999})),
    ],
    ids=["template-changed", "file-added"],
)
def test_a_changed_tokenizer_file_is_loaded_again_and_recorded_anew(model, tmp_path, change):
    RecordedTokenizer(str(model), tmp_path / "cache").recorded_fingerprint()
    before = files_key(str(model))
    change(model)
    assert files_key(str(model)) != before
    again = RecordedTokenizer(str(model), tmp_path / "cache")
    assert again.recorded_fingerprint() == reference(model)[0]
    assert again.loaded


def test_weights_are_not_read_and_a_damaged_record_is_ignored(model, tmp_path):
    key = files_key(str(model))
    (model / "model-00002-of-00002.safetensors").write_bytes(b"not read")
    assert files_key(str(model)) == key
    first = RecordedTokenizer(str(model), tmp_path / "cache")
    first.recorded_fingerprint()
    first.path.write_text('{"fingerprint": {"tokenizer_hash": 1}}')
    again = RecordedTokenizer(str(model), tmp_path / "cache")
    assert again.recorded_fingerprint() == reference(model)[0] and again.loaded


def test_a_hub_id_has_no_record():
    assert files_key("Qwen/Qwen3.5-0.8B") is None


def test_a_second_load_rebuilds_the_snapshot_and_a_changed_snapshot_file_is_not_used(model, tmp_path):
    first = RecordedTokenizer(str(model), tmp_path / "cache")
    assert isinstance(first.load(), SnapshotTokenizer) and first.snapshot_path.is_file()
    again = RecordedTokenizer(str(model), tmp_path / "cache").load()
    assert isinstance(again, SnapshotTokenizer)
    assert tokenizer_fingerprint(again) == reference(model)[0]

    snapshot = json.loads(first.snapshot_path.read_text())
    snapshot["chat_template"] += " "
    first.snapshot_path.write_text(json.dumps(snapshot))
    third = RecordedTokenizer(str(model), tmp_path / "cache")
    assert tokenizer_fingerprint(third.load()) == reference(model)[0]  # loaded again, snapshot taken anew
    assert json.loads(first.snapshot_path.read_text())["chat_template"] == first.load().chat_template
