"""dry-run passes on a correct setup and fails loudly on an off-by-one capture, NaN states and zero states."""

import json

import pytest
import torch
from support.cli import TINY_LIMITS, cli_run_args, run_cli, write_mixed_dataset
from support.faults import ShiftedCapture

from hsextract.config import RunConfig
from hsextract.dryrun import dry_run, format_report
from hsextract.model.load import load_model
from hsextract.run import pipeline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model, tiny_tokenizer):
    root = tmp_path_factory.mktemp("dry")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer)
    cfg = RunConfig(
        model=str(tiny_model),
        data=str(data),
        output=str(root / "o"),
        run_dir=str(root / "r"),
        layers=(0, 3, 7),
        device="cpu",
        dtype="float32",
        shards=2,
        **TINY_LIMITS,
        num_proc=1,
    )
    return root, cfg


def test_correct_setup_passes_with_layer_map(setup):
    _, cfg = setup
    result = dry_run(cfg, num_samples=6)
    assert result.ok, format_report(result.report)
    layers = result.report["layers"]
    assert [e["layer_id"] for e in layers] == [0, 3, 7]
    assert [e["hf_output_hidden_states_index"] for e in layers] == [1, 4, 8]
    assert [e["vllm_input_of_layer_id"] for e in layers] == [1, 4, 8]
    assert [e["layer_type"] for e in layers] == ["linear_attention", "full_attention", "full_attention"]
    for e in layers:
        assert e["rel_err_vs_hf"] < 1e-5
        assert e["rel_err_vs_neighbour_layers"] > 0.1
    text = format_report(result.report)
    assert "dry run passed" in text and "ETA" in text
    # Which trainers' formats these layers serve, before the run, by the rule the export refuses with.
    assert "serves: specforge-dflash, specforge-dflash2" in text
    assert "does not serve specforge-dspark, specforge-eagle3, speculators, modelopt" in text
    assert "needs the final hidden state: extract with --final-state" in text
    # The first sample as the target sees it, its loss-masked tokens marked: exactly the assistant turns.
    first = result.report["chat"]["first_sample"]
    assert "chat template: the tokenizer's own" in text and first in text
    assert first and "«" in first, first


def test_capture_shifted_by_one_layer_fails_loudly(setup, monkeypatch):
    _, cfg = setup
    cfg = RunConfig(**{**cfg.to_json(), "layers": (0, 3, 5)})
    monkeypatch.setattr(pipeline, "LayerCapture", ShiftedCapture)  # the bug planted in the capture path only
    result = dry_run(cfg, num_samples=4)
    assert not result.ok
    assert any("off-by-one" in w for w in result.report["warnings"]), result.report["warnings"]
    assert "FAILED" in format_report(result.report)


def test_nan_states_fail(setup):
    _, cfg = setup
    lm = load_model(cfg.model, dtype="float32", device="cpu")
    with torch.no_grad():
        lm.model.layers[2].mlp.down_proj.weight.fill_(float("nan"))
    result = dry_run(cfg, num_samples=4, lm=lm)
    assert not result.ok
    assert any("NaN" in w for w in result.report["warnings"])
    assert result.report["layers"][0]["nan"] == 0 and result.report["layers"][1]["nan"] > 0


def test_zero_states_fail(setup):
    _, cfg = setup
    lm = load_model(cfg.model, dtype="float32", device="cpu")
    with torch.no_grad():
        lm.model.embed_tokens.weight.zero_()
    result = dry_run(cfg, num_samples=4, lm=lm)
    assert not result.ok
    assert any("all zeros" in w for w in result.report["warnings"])


def test_estimate_matches_what_a_real_run_writes(setup, tmp_path):
    root, cfg = setup
    result = dry_run(cfg, num_samples=4)
    est = result.report["estimate"]
    run_cli(
        *cli_run_args(
            tmp_path,
            cfg.model,
            cfg.data,
            layers="0,3,7",
            shards=2,
            **TINY_LIMITS,
            num_proc=1,
            no_progress=True,
        )
    )
    files = list(
        (tmp_path / "out").rglob("shard-*/batch-*.safetensors")
    )  # the batch files, not the sample index
    written = sum(f.stat().st_size for f in files)
    assert len(files) == est["batches"]
    assert abs(written - est["total_bytes"]) / written < 0.01, (written, est["total_bytes"])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_tokens"] == est["tokens"]


def test_cli_json_and_exit_code(setup):
    _, cfg = setup
    r = run_cli(
        "dry-run",
        "--model",
        cfg.model,
        "--data",
        cfg.data,
        "--layers",
        "0,3,7",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-length",
        "300",
        "--max-tokens-per-batch",
        "600",
        "--num-samples",
        "3",
        "--json",
    )
    report = json.loads(r.stdout)
    assert report["ok"] is True
    assert [e["layer_id"] for e in report["layers"]] == [0, 3, 7]
    rows = report["estimate"]["data"]["rows"]
    trial = json.loads(run_cli(*r.args[3:], "--max-samples", 5).stdout)  # the same command, the first 5 rows
    assert trial["ok"] and trial["estimate"]["data"]["rows"] == 5 < rows, trial["estimate"]
    assert trial["estimate"]["samples"] == trial["estimate"]["data"]["kept"] <= 5
    # transformers' advice to install CUDA kernels (flash-linear-attention, causal-conv1d) does not apply on the CPU
    assert "falling back to its reference PyTorch implementation" not in r.stderr, r.stderr
    r = run_cli(
        "dry-run", "--model", cfg.model, "--data", cfg.data, "--layers", "8", "--device", "cpu", check=False
    )
    assert r.returncode == 2 and "out of range" in r.stderr


def test_final_state_and_fp8_are_shown_proven_and_counted(setup):
    _, cfg = setup
    cfg = RunConfig(**{**cfg.to_json(), "layers": "eagle3", "storage_dtype": "float8_e4m3fn"})
    result = dry_run(cfg, num_samples=4)
    report = result.report
    assert result.ok, format_report(report)
    rows = report["layers"]
    assert [e["layer_id"] for e in rows] == [
        1,
        3,
        4,
        7,
    ]  # eagle3 implies the final state: layer 7, one more slot
    final = rows[-1]
    assert final["final_state"] and "final state" in final["captures"]
    assert (
        final["rel_err_vs_hf"] < 1e-5
    )  # the reader's norm rule applied to the stored state = HF's last entry
    assert report["final_state"]["rule"] == "one_plus_weight"
    for e in rows:
        assert 0.01 < e["fp8_rel_err"] < 0.05 and e["fp8_cos_min"] > 0.998
    est = report["estimate"]
    assert est["bytes_per_token"] == 4 * (64 * 1 + 4) + 5  # 4 slots of fp8 + a float32 scale each, id, mask
    assert est["layers_run"] == 8
    text = format_report(report)
    assert "final state: layer 7" in text and "fp8 err" in text


def test_estimate_from_a_sample_says_so_and_scales_to_the_data(setup, monkeypatch):
    from hsextract.prepare import tokenize

    _, cfg = setup
    full = dry_run(cfg, num_samples=3)
    monkeypatch.setattr(tokenize, "SAMPLE_ROWS", 12)
    sampled = dry_run(cfg, num_samples=3)
    est, exact = sampled.report["estimate"], full.report["estimate"]
    assert sampled.ok
    assert est["basis"] == {"from": "sample", "rows_tokenized": 12, "rows": exact["basis"]["rows"]}
    assert exact["basis"]["from"] == "all rows"
    assert abs(est["samples"] - exact["samples"]) <= exact["samples"] * 0.1
    assert "estimate from a sample: the first rows of each source, 12 of" in format_report(sampled.report)


def test_union_of_presets_is_proven_once_and_its_storage_shown_per_preset(setup):
    _, cfg = setup
    cfg = RunConfig(**{**cfg.to_json(), "layers": "dflash,dflash2,dspark,eagle3"})
    result = dry_run(cfg, num_samples=3)
    assert result.ok, format_report(result.report)
    # 8 layers: dflash = dflash2 = dspark = [1..5], eagle3 [1, 3, 4]; dspark and eagle3 add the final state (7).
    assert [e["layer_id"] for e in result.report["layers"]] == [1, 2, 3, 4, 5, 7]
    rows = {r["name"]: r for r in result.report["estimate"]["storage"]}
    assert list(rows) == ["dflash", "dflash2", "dspark", "eagle3", "union"]
    assert rows["eagle3"]["layer_ids"] == [1, 3, 4] and rows["eagle3"]["slots"] == 4
    assert rows["dflash"]["slots"] == 5 and rows["union"]["slots"] == 6
    hidden = 64
    tokens = result.report["estimate"]["tokens"]
    for r in rows.values():
        assert r["bytes_per_token"]["float32"] == r["slots"] * hidden * 4 + 5
        assert r["bytes_per_token"]["float8_e4m3fn"] == r["slots"] * (hidden + 4) + 5
        assert r["total_bytes"]["float32"] > tokens * r["bytes_per_token"]["float32"]
    assert result.report["estimate"]["bytes_per_token"] == rows["union"]["bytes_per_token"]["float32"]
    text = format_report(result.report)
    assert "  eagle3   [1, 3, 4 + final state] 4 slots" in text
    assert (
        all(p is None for p in result.report["estimate"]["formats"].values()) and "does not serve" not in text
    )


def test_target_topk_is_proven_against_hf_logits_and_its_storage_counted(setup):
    _, cfg = setup
    cfg = RunConfig(**{**cfg.to_json(), "layers": (0, 3), "target_topk": 8})
    result = dry_run(cfg, num_samples=4)
    report = result.report
    assert result.ok, format_report(report)
    topk = report["target_topk"]
    assert topk["ok"] and topk["rel_err_vs_hf"] < 1e-5 and topk["ids_outside"] == 0
    assert topk["tokens"] == report["proof"]["tokens"]
    est = report["estimate"]
    assert (
        est["layers_run"] == 8
    )  # to the last layer for the final state, though layer 3 is the deepest captured
    assert est["target_topk"]["bytes_per_token"] == 64 and est["bytes_per_token"] == 2 * 64 * 4 + 5 + 64
    assert est["target_topk"]["total_bytes"] == 64 * est["tokens"]
    text = format_report(report)
    assert "target top-k:" in text and "target top-8: +64 bytes/token" in text


def test_target_topk_shifted_by_one_token_fails_the_proof(setup, monkeypatch):
    from hsextract.model import capture

    real = capture.target_topk_

    def shifted(normed, lm_head, ids, logprobs, *, chunk_tokens):  # each token given its successor's top-k
        real(normed.roll(-1, 0), lm_head, ids, logprobs, chunk_tokens=chunk_tokens)

    monkeypatch.setattr(capture, "target_topk_", shifted)
    _, cfg = setup
    result = dry_run(RunConfig(**{**cfg.to_json(), "layers": (0, 3), "target_topk": 8}), num_samples=4)
    assert not result.ok and not result.report["target_topk"]["ok"]
    assert any("target top-8" in w for w in result.report["warnings"]), result.report["warnings"]


def test_the_qwen3_6_recipe_with_earlier_reasoning_passes_and_counts_what_the_template_drops(
    setup, tiny_lm, tmp_path
):
    """Reasoning in turns before a later user message is what Qwen3.6's template (and so the server) drops: a
    count in the report, not a failure; the reasoning of the last reply is rendered."""
    from support.served_rows import CHAT_TEMPLATES, conversations

    root, cfg = setup
    data = tmp_path / "reasoning.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    template = str(CHAT_TEMPLATES / "qwen3_6.jinja")
    for kwargs in ('{"enable_thinking": true}', '{"enable_thinking": false}'):
        recipe = RunConfig(
            **{**cfg.to_json(), "data": str(data), "chat_template": template, "chat_template_kwargs": kwargs}
        )
        result = dry_run(recipe, num_samples=4, lm=tiny_lm)
        text = format_report(result.report)
        assert result.ok, text
        [note] = result.report["notes"]
        assert note.endswith(
            "sampled rows carry earlier reasoning that the chat template drops, as the server does (counted)"
        )
        assert f"note: {note}" in text and "dry run passed" in text
