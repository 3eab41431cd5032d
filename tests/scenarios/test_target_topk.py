"""``hsextract run --target-topk K`` in real processes: the stored top-k equals HF's
``logits.log_softmax(-1).topk(K)`` on every supervised token, and ``hsextract verify`` passes the output."""

import json

import pytest
import torch
from support.cli import TINY_LIMITS, cli_run_args, run_cli, write_mixed_dataset
from support.compare import assert_topk_matches_hf

from hsextract.output import open_output, verify_output

pytestmark = pytest.mark.slow


def test_run_stores_the_targets_topk_equal_to_hf_on_supervised_tokens(
    tmp_path, tiny_model, tiny_tokenizer, tiny_lm
):
    data = write_mixed_dataset(tmp_path / "data.jsonl", tiny_tokenizer, n_chat=12)
    args = cli_run_args(
        tmp_path,
        tiny_model,
        data,
        layers="dflash",
        target_topk=5,
        **TINY_LIMITS,
        num_proc=1,
        no_progress=True,
    )
    run_cli(*args)
    out = tmp_path / "out"
    assert json.loads((out / "manifest.json").read_text())["target_topk"] == 5
    assert verify_output(str(out), show_progress=False).ok
    supervised_tokens = 0
    for s in open_output(out):
        mask = s["loss_mask"]
        with torch.inference_mode():
            logits = tiny_lm(s["input_ids"][None]).logits[0]
        assert_topk_matches_hf(
            s["target_topk_ids"][mask], s["target_topk_logprobs"][mask], logits[mask], where=s["sample_id"]
        )
        supervised_tokens += int(mask.sum())
    assert supervised_tokens > 500
