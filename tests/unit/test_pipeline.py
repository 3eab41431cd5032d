"""The per-batch state check of the pipeline: counts per stored layer, the refusal naming batch and layer."""

import pytest
import torch

from hsextract.format.fp8 import quantize_fp8
from hsextract.prepare.plan import BatchSpec
from hsextract.run.pipeline import BadStatesError, refuse_bad_states, state_health


def states_with_damage() -> torch.Tensor:
    x = torch.randn(6, 3, 16)
    x[2, 1, 5] = float("nan")
    x[4, 1, 0] = float("inf")
    x[3, 2] = 0.0
    return x


@pytest.mark.parametrize("fp8", [False, True])
def test_state_health_counts_non_finite_and_all_zero_tokens_per_layer(fp8):
    x = states_with_damage()
    if fp8:
        q, scale = quantize_fp8(x)
        health = state_health(q, scale)
    else:
        health = state_health(x.to(torch.bfloat16), None)
    assert health.tolist() == [[0, 2, 0], [0, 0, 1]]
    assert state_health(torch.randn(6, 3, 16), None).tolist() == [[0, 0, 0], [0, 0, 0]]


def test_bad_states_are_refused_naming_the_batch_and_the_first_bad_layer():
    batch = BatchSpec(batch_id=7, shard=1, sample_indices=(0, 1), num_tokens=6, padded_length=3)
    with pytest.raises(
        BadStatesError, match=r"batch 7 \(shard 1, .*\): layer 16 has 2 token\(s\) with NaN or Inf"
    ):
        refuse_bad_states(state_health(states_with_damage(), None), batch, (1, 16, 31), torch.float16)
    with pytest.raises(BadStatesError, match=r"layer 31 has 1 token\(s\) whose state is all zeros of 6"):
        x = states_with_damage()
        x[:, 1] = 1.0
        refuse_bad_states(state_health(x, None), batch, (1, 16, 31), torch.float16)
    refuse_bad_states(state_health(torch.ones(6, 3, 16), None), batch, (1, 16, 31), torch.float16)
