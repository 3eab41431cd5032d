"""prepare/tokenizer_record.py: a launch from the token cache takes the tokenizer's fingerprint and pad id from
the record its files match, without loading it; any change to those files loads the tokenizer again. The reference
is ``tokenizer_fingerprint`` of the tokenizer as ``load_tokenizer`` makes it."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from hsextract.prepare.snapshot_tokenizer import SnapshotTokenizer
from hsextract.prepare.tokenize import load_tokenizer, tokenizer_fingerprint
from hsextract.prepare.tokenizer_record import RecordedTokenizer, files_key
from hsextract.validation import seal


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


def test_the_slow_first_use_of_a_tokenizer_says_what_it_does_and_a_recorded_one_is_silent(model, tmp_path):
    said = []
    first = RecordedTokenizer(str(model), tmp_path / "cache", echo=said.append)
    first.load()
    first.tiktoken_spec()
    assert [line.split(":")[0] for line in said] == ["tokenizer", "tokenizer"], said
    assert "loading it through transformers" in said[0] and "checking the tiktoken fast path" in said[1]
    said.clear()
    again = RecordedTokenizer(str(model), tmp_path / "cache", echo=said.append)
    again.load()
    again.tiktoken_spec()
    assert said == []  # the record and the snapshot answer at once


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
    snapshot["value"]["chat_template"] += " "
    first.snapshot_path.write_text(json.dumps(snapshot))
    third = RecordedTokenizer(str(model), tmp_path / "cache")
    assert tokenizer_fingerprint(third.load()) == reference(model)[0]  # loaded again, snapshot taken anew
    assert json.loads(first.snapshot_path.read_text())["value"]["chat_template"] == first.load().chat_template


PROBE = "Hello wörld, 数字 <|im_end|> 12345 tokens\n\n  end"


def ids_of(tokenizer) -> list[int]:
    return tokenizer.backend_tokenizer.encode(PROBE, add_special_tokens=False).ids


def swapped_snapshot(kept: dict) -> dict:
    """The kept snapshot with the ids of two of the probe's tokens swapped: a well-formed tokenizer giving other
    ids."""
    backend = json.loads(kept["value"]["backend"])
    vocab = backend["model"]["vocab"]
    first, second = ids_of(SnapshotTokenizer(kept["value"]))[1:3]
    a, b = (next(t for t, i in vocab.items() if i == want) for want in (first, second))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return {**kept, "value": {**kept["value"], "backend": json.dumps(backend)}}


def test_a_snapshot_edited_with_its_sha256_never_changes_the_ids(model, tmp_path):
    want = ids_of(load_tokenizer(str(model)))
    first = RecordedTokenizer(str(model), tmp_path / "cache")
    assert ids_of(first.load()) == want
    kept, record = json.loads(first.snapshot_path.read_text()), json.loads(first.path.read_text())
    assert ids_of(SnapshotTokenizer(swapped_snapshot(kept)["value"])) != want  # the edit changes the ids
    for snapshot, reseal_record in ((seal(swapped_snapshot(kept)), False), (swapped_snapshot(kept), True)):
        text = json.dumps(snapshot)
        first.snapshot_path.write_text(text)
        edited = {**record, "snapshot_sha256": hashlib.sha256(text.encode()).hexdigest()}
        first.path.write_text(json.dumps(seal(edited) if reseal_record else edited))
        again = RecordedTokenizer(str(model), tmp_path / "cache")
        assert ids_of(again.load()) == want and again.recorded_fingerprint() == reference(model)[0]
        assert not isinstance(again.load(), SnapshotTokenizer) or json.loads(
            first.snapshot_path.read_text()
        ) == json.loads(json.dumps(kept))  # loaded through transformers, the snapshot taken anew


def test_another_models_records_copied_under_this_models_key_are_not_used(model, tmp_path):
    other = shutil.copytree(model, tmp_path / "other")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'other' }}"}))
    theirs = RecordedTokenizer(str(other), tmp_path / "cache")
    theirs.load()
    mine = RecordedTokenizer(str(model), tmp_path / "cache")
    assert mine.path != theirs.path
    for name in ("path", "snapshot_path"):
        getattr(mine, name).write_bytes(getattr(theirs, name).read_bytes())
    again = RecordedTokenizer(str(model), tmp_path / "cache")
    assert again.recorded_fingerprint() == reference(model)[0] and again.loaded
    assert again.load().chat_template == load_tokenizer(str(model)).chat_template


@pytest.mark.parametrize(
    "pad",
    [5, -7, 10**12, None, "5", True],
    ids=["other-id", "negative", "past-vocab", "null", "string", "bool"],
)
def test_a_pad_id_edited_in_the_record_is_never_used(model, tmp_path, pad):
    first = RecordedTokenizer(str(model), tmp_path / "cache")
    first.recorded_fingerprint()
    record = {**json.loads(first.path.read_text()), "pad_token_id": pad}
    first.path.write_text(json.dumps(record if pad == 5 else seal(record)))  # 5 fits: only the seal tells
    again = RecordedTokenizer(str(model), tmp_path / "cache")
    assert again.pad_token_id == reference(model)[1] and again.loaded
    assert json.loads(first.path.read_text())["pad_token_id"] == reference(model)[1]  # recorded again


def test_a_directory_where_a_record_goes_is_said_and_the_run_goes_on(model, tmp_path, caplog):
    first = RecordedTokenizer(str(model), tmp_path / "cache")
    first.path.mkdir(parents=True)  # a directory where the record goes (was: IsADirectoryError)
    with caplog.at_level("WARNING"):
        assert first.recorded_fingerprint() == reference(model)[0]
    assert (
        f"the tokenizer's record {first.path} is not kept" in caplog.text and "is a directory" in caplog.text
    )
    assert first.path.is_dir() and not any(first.path.iterdir())  # never removed: hsextract did not make it
