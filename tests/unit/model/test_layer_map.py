"""`hsextract layers`: each preset's ids for a model from its config.json alone (a directory holding nothing else,
or a Hub id's file in the Hugging Face cache), in hsextract's count and vLLM's, against FACTS.md's published ids."""

import json

from click.testing import CliRunner

from hsextract.cli import main

# FACTS.md, for the 64-layer Qwen3.6-27B: output-of-layer-k ids; vLLM/speculators count the input (k + 1).
PUBLISHED = {
    "dflash": [1, 16, 31, 46, 61],
    "dflash2": [5, 19, 33, 47, 61],
    "dspark": [1, 16, 31, 46, 61],
    "eagle3": [1, 31, 60],
}


def _config_only(path, layers=64):
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_5",
                "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": layers},
            }
        )
    )
    return path


def _layers(*args):
    result = CliRunner().invoke(main, ["layers", *map(str, args)])
    assert isinstance(result.exception, SystemExit | None), result.exception
    return result


def test_each_preset_in_both_counts_from_a_directory_holding_only_config_json(tmp_path):
    model = _config_only(tmp_path / "qwen36")
    result = _layers("--model", model, "--layers", "dflash,eagle3")
    assert result.exit_code == 0, result.output
    assert f"{model}: 64 decoder layers" in result.stdout
    assert "dflash  [1, 16, 31, 46, 61]; vLLM/speculators: [2, 17, 32, 47, 62]" in result.stdout
    assert "eagle3  [1, 31, 60] + the final state; vLLM/speculators: [2, 32, 61]" in result.stdout
    assert "union: [1, 16, 31, 46, 60, 61] + the final state" in result.stdout
    doc = json.loads(_layers("--model", model, "--json").stdout)  # every preset by default
    for row in doc["presets"]:
        assert row["layer_ids"] == PUBLISHED[row["preset"]]
        assert row["vllm_ids"] == [k + 1 for k in PUBLISHED[row["preset"]]]
        assert row["final_state"] == (row["preset"] in ("dspark", "eagle3"))
    assert doc["union"]["slots_per_token"] == 11


def test_a_hub_id_reads_its_config_json_from_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "a" * 40
    repo = tmp_path / "hub" / "models--Qwen--Qwen3.6-27B"
    _config_only(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = _layers("--model", "Qwen/Qwen3.6-27B", "--layers", "dflash2")
    assert result.exit_code == 0, result.output
    assert "Qwen/Qwen3.6-27B: 64 decoder layers" in result.stdout
    assert "dflash2  [5, 19, 33, 47, 61]; vLLM/speculators: [6, 20, 34, 48, 62]" in result.stdout
    missing = _layers("--model", "Qwen/Not-Cached")
    assert missing.exit_code == 2 and "not in the Hugging Face cache" in missing.stderr
    assert "HF_HUB_OFFLINE=1" in missing.stderr and "did you mean" not in missing.stderr
    mistyped = _layers("--model", "Qwen/qwen3.6-27b")
    assert mistyped.exit_code == 2
    assert (
        f"did you mean Qwen/Qwen3.6-27B (in the Hugging Face cache at {tmp_path / 'hub'})?" in mistyped.stderr
    )


def test_ids_out_of_range_and_a_config_without_layers_are_one_line_each(tmp_path):
    model = _config_only(tmp_path / "m", layers=8)
    result = _layers("--model", model, "--layers", "3,9")
    assert result.exit_code == 2 and "out of range" in result.stderr
    (model / "config.json").write_text("{}")
    result = _layers("--model", model)
    assert result.exit_code == 2 and "has no num_hidden_layers" in result.stderr
