"""Rows that share a prefix, captured with the prefix computed once (model/prefix.py): the schedule, the tokens
it computes, and the states against an unbatched HF forward of each whole row."""

import pytest
import torch
from support.turns import distinct_tokens, turn_rows

from hsextract.model.capture import GatherTarget, LayerCapture
from hsextract.model.prefix import Segment, capture_into, computed_tokens, prefix_schedule


def test_schedule_computes_each_trie_node_once_and_keeps_checkpoints_at_branch_points():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 9], [8]]
    schedule = prefix_schedule(rows)
    assert schedule == [
        [Segment(0, 0, 2, keep=True), Segment(0, 2, 3, keep=True), Segment(0, 3, 4, keep=False)],
        [Segment(1, 3, 5, keep=False)],
        [Segment(2, 2, 3, keep=False)],
        [Segment(3, 0, 1, keep=False)],
    ]
    assert computed_tokens(rows) == distinct_tokens(rows) == 8


def test_schedule_of_rows_that_are_prefixes_or_repeats_still_ends_each_row_with_a_forward():
    rows = [[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3, 4]]
    schedule = prefix_schedule(rows)
    assert sorted(segs[-1].row for segs in schedule) == [0, 1, 2, 3]
    assert all(segs[-1].end == len(rows[segs[-1].row]) and not segs[-1].keep for segs in schedule)
    assert computed_tokens(rows) <= sum(map(len, rows))


@pytest.mark.parametrize("turns", [3, 10])
def test_per_turn_rows_compute_each_shared_prefix_once(turns):
    rows = turn_rows(turns, seed=turns)
    stored, distinct = sum(map(len, rows)), distinct_tokens(rows)
    assert computed_tokens(rows) == distinct <= 1.15 * distinct
    assert stored > (1.3 if turns == 3 else 3) * distinct  # what computing each row whole would cost


def reference(lm, ids: torch.Tensor) -> tuple:
    with torch.inference_mode():
        return lm(ids[None], output_hidden_states=True).hidden_states  # [k + 1]: the output of layer k


def check_rows(lm, rows: list[list[int]], layer_ids: tuple[int, ...]) -> None:
    hidden = lm.config.get_text_config().hidden_size
    tensors = [torch.tensor(r) for r in rows]
    n = sum(map(len, rows))
    target = GatherTarget(None, torch.full((n, len(layer_ids), hidden), float("nan")))
    with LayerCapture(lm, layer_ids) as cap, torch.inference_mode():
        capture_into(cap, tensors, target)
    got = target.out.split([len(r) for r in rows])
    for ids, states in zip(tensors, got, strict=True):
        assert states.shape == (len(ids), len(layer_ids), hidden)
        ref = reference(lm, ids)
        for j, k in enumerate(layer_ids):
            torch.testing.assert_close(states[:, j], ref[k + 1][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("turns", [3, 10])
def test_prefix_shared_states_equal_each_whole_row_qwen3_5(tiny_lm, turns):
    # Layers 1 and 6 straddle full-attention layer 3 and Gated-DeltaNet layers on both sides.
    check_rows(tiny_lm, turn_rows(turns, seed=turns), (1, 3, 6))


def test_prefix_shared_states_equal_each_whole_row_stopping_before_any_full_attention_layer(tiny_lm):
    check_rows(tiny_lm, turn_rows(3, seed=5), (0, 1))


def test_prefix_shared_states_equal_each_whole_row_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=500,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    )
    check_rows(LlamaForCausalLM(config).eval(), turn_rows(10, seed=1), (0, 2))
