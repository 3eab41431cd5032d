"""training/batching.py: token-budget batches grouped by length, on lengths laid out like an output's files."""

import random

import pytest

from hsextract.training.batching import token_budget_batches


def layout(n_files=40, seed=0):
    """Lengths of 1..600 tokens in files of 1..12 samples, each file's samples of similar length (as a plan makes)."""
    rng = random.Random(seed)
    lengths, files = [], []
    for _ in range(n_files):
        base = rng.randint(1, 600)
        files.append([len(lengths) + j for j in range(rng.randint(1, 12))])
        lengths += [max(1, min(600, base + rng.randint(-20, 20))) for _ in files[-1]]
    rng.shuffle(files)
    return lengths, files


def padding_waste(batches, lengths) -> float:
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / padded


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_sample_once_within_the_budget_and_ranks_take_equal_steps(world_size):
    lengths, files = layout()
    batches = token_budget_batches(lengths, files, 1000, seed=1, epoch=0, world_size=world_size)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 1000 for b in batches)
    assert len(batches) % world_size == 0
    # Packed, not padded out: most batches leave less than the longest sample's room unused.
    assert sum(1000 - sum(lengths[i] for i in b) < 600 for b in batches) > 0.8 * len(batches)


def test_batches_group_similar_lengths_and_each_epoch_is_its_own():
    lengths, files = layout()
    ours = token_budget_batches(lengths, files, 1000, seed=1, epoch=0, window_files=8)
    # The same batch sizes filled at random instead: far more padding.
    rng = random.Random(5)
    pool = list(range(len(lengths)))
    rng.shuffle(pool)
    sizes, shuffled = [len(b) for b in ours], []
    for n in sizes:
        shuffled.append(pool[:n])
        pool = pool[n:]
    assert padding_waste(ours, lengths) < 0.5 * padding_waste(shuffled, lengths)
    again = token_budget_batches(lengths, files, 1000, seed=1, epoch=0, window_files=8)
    assert again == ours
    assert token_budget_batches(lengths, files, 1000, seed=1, epoch=1, window_files=8) != ours
    assert token_budget_batches(lengths, files, 1000, seed=2, epoch=0, window_files=8) != ours


def test_max_samples_caps_a_batch_and_too_few_samples_leave_ranks_one_apart():
    lengths, files = layout()
    capped = token_budget_batches(lengths, files, 10_000, seed=0, epoch=0, max_samples=4)
    assert max(map(len, capped)) <= 4
    assert sorted(i for b in capped for i in b) == list(range(len(lengths)))
    few = token_budget_batches([5, 5, 5], [[0, 1, 2]], 100, seed=0, epoch=0, world_size=4)
    assert sorted(map(len, few)) == [1, 1, 1]
