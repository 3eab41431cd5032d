"""``TokenBudgetBatches`` over a real output's ``StatesMapDataset``, read through real DataLoader workers: the tokens of
the items read (not the index's lengths) stay within the budget, and the manifest says which samples exist."""

from __future__ import annotations

import json

import pytest
from torch.utils.data import DataLoader

from hsextract.errors import HsextractError
from hsextract.training import StatesMapDataset, TokenBudgetBatches

pytestmark = pytest.mark.slow


def as_list(batch):
    return batch


def test_two_ranks_take_equal_steps_of_budgeted_batches_with_every_sample_once(finished_run):
    out = finished_run[0] / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    expected = [sid for b in manifest["batches"] for sid in b["sample_ids"]]
    data = StatesMapDataset(out)
    budget = 2 * max(data.lengths)
    ranks = []
    for rank in range(2):
        batches = TokenBudgetBatches(data, budget, seed=3, rank=rank, world_size=2, window_files=4)
        batches.set_epoch(1)
        got = list(DataLoader(data, batch_sampler=batches, num_workers=2, collate_fn=as_list))
        assert [[s["sample_id"] for s in b] for b in got] == [
            [data.sample_ids[i] for i in b] for b in batches.rank_batches()
        ]
        assert all(sum(len(s["input_ids"]) for s in b) <= budget for b in got)
        assert len(got) == len(batches)
        ranks.append([s["sample_id"] for b in got for s in b])
        # Resume: a state after 2 steps (through JSON) gives exactly the rest of the epoch.
        resumed = TokenBudgetBatches(data, budget, seed=3, rank=rank, world_size=2, window_files=4)
        resumed.load_state_dict(json.loads(json.dumps(batches.state_dict(consumed=2))))
        assert list(resumed) == batches.rank_batches()[2:]
    assert sorted(ranks[0] + ranks[1]) == sorted(expected) and len(expected) == len(set(expected))
    assert len(TokenBudgetBatches(data, budget, seed=3, rank=0, world_size=2, window_files=4)) == len(batches)
    with pytest.raises(HsextractError, match="seed=3"):
        TokenBudgetBatches(data, budget, seed=4, rank=1, world_size=2, window_files=4).load_state_dict(
            batches.state_dict(consumed=1)
        )


def test_a_sample_over_the_budget_is_refused_with_the_budget_it_needs(finished_run):
    data = StatesMapDataset(finished_run[0] / "out")
    longest = max(data.lengths)
    with pytest.raises(HsextractError, match=f"longest has {longest} tokens.*at least {longest}"):
        TokenBudgetBatches(data, max_tokens=longest - 1)
