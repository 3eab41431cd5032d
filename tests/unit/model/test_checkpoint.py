"""A model directory without a tokenizer or with weight files missing or cut short is refused by `run` and
`dry-run` before any row is read, naming the files (the command in this process, through click's CliRunner)."""

import json
import shutil

import pytest
from click.testing import CliRunner
from support.cli import TINY_LIMITS, cli_run_args, write_mixed_dataset

from hsextract.cli import main
from hsextract.model.checkpoint import missing_weights, safetensors_problem

pytestmark = pytest.mark.usefixtures("restored_process_state")


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_tokenizer):
    return write_mixed_dataset(tmp_path_factory.mktemp("ckpt") / "data.jsonl", tiny_tokenizer, n_chat=3)


def _refused(args, *needles):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert isinstance(result.exception, SystemExit | None), result.exception  # a message, not a traceback
    assert result.exit_code == 2, result.output
    for needle in needles:
        assert needle in result.stderr, result.stderr
    return result.stderr


def _copy(tiny_model, dest, *, drop=()):
    shutil.copytree(tiny_model, dest)
    for name in drop:
        (dest / name).unlink()
    return dest


def _run(model, data, root):
    return cli_run_args(root, model, data, num_proc=1, no_progress=True, **TINY_LIMITS)


def test_a_model_without_tokenizer_files_is_refused_before_any_row_is_read(tiny_model, data, tmp_path):
    model = _copy(
        tiny_model, tmp_path / "m", drop=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    )
    err = _refused(
        _run(model, data, tmp_path), "has no tokenizer", "tokenizer.json", "config.json, generation"
    )
    assert "usable" not in err and "rows" not in err  # the data is not blamed
    assert not (tmp_path / "run").exists()  # refused before the run dir is made
    # Pre-tokenized rows alone need the tokenizer too (its pad id, its vocabulary's range).
    tokens_only = tmp_path / "tokens.jsonl"
    tokens_only.write_text("".join(line for line in data.read_text().splitlines(True) if "input_ids" in line))
    _refused(_run(model, tokens_only, tmp_path), "has no tokenizer")
    _refused(["dry-run", "--model", model, "--data", data, "--device", "cpu"], "has no tokenizer")
    # vocab.json alone is half a BPE tokenizer.
    (model / "vocab.json").write_text("{}")
    _refused(_run(model, data, tmp_path), "has vocab.json but no merges.txt")


def test_a_model_without_weights_is_refused_by_run_and_dry_run(tiny_model, data, tmp_path):
    model = _copy(tiny_model, tmp_path / "m", drop=("model.safetensors",))
    _refused(
        _run(model, data, tmp_path), "has no weights", "model.safetensors", "it holds chat_template.jinja"
    )
    assert not (tmp_path / "run").exists()
    dry = ["dry-run", "--model", model, "--data", data, "--device", "cpu", "--dtype", "float32"]
    _refused(dry, "has no weights")


def test_a_shard_the_index_names_missing_or_cut_short_is_named(tiny_lm, tiny_model, data, tmp_path):
    model = _copy(tiny_model, tmp_path / "m", drop=("model.safetensors",))
    tiny_lm.save_pretrained(model, max_shard_size="300KB")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and missing_weights(model) is None
    (model / shards[1]).rename(tmp_path / "aside")
    _refused(_run(model, data, tmp_path), f"1 of the {len(shards)} weight files", shards[1], "incomplete")
    (tmp_path / "aside").rename(model / shards[1])
    whole = (model / shards[0]).stat().st_size
    with open(model / shards[0], "r+b") as f:
        f.truncate(whole - 100)
    _refused(_run(model, data, tmp_path), shards[0], f"has {whole - 100:,} bytes of the {whole:,}")


def test_a_safetensors_header_is_checked_against_the_file_length(tiny_model, tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(10), "b": torch.ones(3, 2)}, str(path))
    assert safetensors_problem(path) is None
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-1])
    assert safetensors_problem(path) == f"has {size - 1:,} bytes of the {size:,} its header describes"
    path.write_bytes(b"\xff" * 12)
    assert "declares a header of" in safetensors_problem(path)
    path.write_bytes(b"abc")
    assert safetensors_problem(path) == "has 3 bytes, not even a header"


def test_a_broken_link_is_named_as_such_not_as_a_file_not_there(tiny_model, data, tmp_path):
    """A Hub cache's weight link whose blob is gone, and a config.json link in a loop: the link is named with
    what is wrong with it (was: "none of model.safetensors is there (it holds model.safetensors)")."""
    model = _copy(tiny_model, tmp_path / "m", drop=("model.safetensors",))
    (model / "model.safetensors").symlink_to(tmp_path / "blobs" / "abc123")
    err = _refused(_run(model, data, tmp_path), "model.safetensors is a symbolic link to")
    assert "blobs/abc123, which is not there" in err and "none of" not in err
    (model / "model.safetensors").unlink()
    shutil.copy(tiny_model / "model.safetensors", model / "model.safetensors")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(model / "loop")
    (model / "loop").symlink_to(model / "config.json")
    err = _refused(_run(model, data, tmp_path), "config.json is a symbolic link in a loop")
    assert "has no config.json" not in err


@pytest.mark.parametrize("value", [-1, "7", 0, 7.0, True])
def test_a_layer_count_that_is_not_a_positive_int_is_named_with_its_value(tiny_model, tmp_path, value):
    from hsextract.errors import HsextractError
    from hsextract.model.load import load_model_config

    model = _copy(tiny_model, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config", config)
    text["num_hidden_layers"] = value
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(HsextractError) as e:
        load_model_config(str(model))
    said = f"config.json's num_hidden_layers is {json.dumps(value)} ({type(value).__name__}), not a positive whole"
    assert said in str(e.value) and "has no num_hidden_layers" not in str(e.value)
