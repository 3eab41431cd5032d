"""The plan (prepare/plan.py make_plan, output/plan.py its record): both bounds, every sample once, stable hash, balanced
shards, little padding."""

import numpy as np
import pytest

from hsextract.output import Plan
from hsextract.prepare.plan import fingerprint_changes, make_plan


def realistic_lengths(n=20000, seed=0):
    """Median 221, mean ~332, p99 ~1800 tokens: the realistic chat mix (scripts/benchlib.py)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(221), 0.9, n).astype(int), 1, 8192).tolist()


def test_batches_respect_both_bounds_and_cover_every_sample_once():
    lengths = realistic_lengths()
    plan = make_plan(lengths, max_tokens_per_batch=65536, max_rows=512, shards=4)
    seen = [i for b in plan.batches for i in b.sample_indices]
    assert sorted(seen) == list(range(len(lengths)))
    assert seen == sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first, ties by index
    for b in plan.batches:
        assert b.rows <= 512
        assert b.padded_tokens <= 65536
        assert b.padded_length == max(lengths[i] for i in b.sample_indices)
        assert b.num_tokens == sum(lengths[i] for i in b.sample_indices)


def test_plan_is_identical_across_runs_and_hash_is_stable(tmp_path):
    lengths = realistic_lengths()
    a = make_plan(lengths, max_tokens_per_batch=65536, max_rows=512, shards=4, fingerprint={"data": "x"})
    b = make_plan(
        list(lengths), max_tokens_per_batch=65536, max_rows=512, shards=4, fingerprint={"data": "x"}
    )
    assert a == b and a.plan_hash == b.plan_hash
    a.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == a
    c = make_plan(lengths, max_tokens_per_batch=65536, max_rows=256, shards=4, fingerprint={"data": "x"})
    assert c.plan_hash != a.plan_hash


def test_shards_get_about_the_same_tokens():
    plan = make_plan(realistic_lengths(), max_tokens_per_batch=65536, max_rows=512, shards=4)
    per = plan.shard_tokens()
    assert max(per) / min(per) < 1.02, per


def test_realistic_padding_waste_under_two_percent():
    # 100k samples: a dense length distribution, as in a real dataset (~1M rows). Tiny datasets waste more
    # because their long tail is sparse.
    plan = make_plan(realistic_lengths(100_000), max_tokens_per_batch=65536, max_rows=512, shards=4)
    assert plan.padding_waste < 0.02, plan.summary()
    assert "padding waste" in plan.summary()


def test_longest_batch_comes_first_in_each_shard():
    plan = make_plan(realistic_lengths(2000), max_tokens_per_batch=16384, max_rows=64, shards=2)
    for s in range(2):
        lengths = [b.padded_length for b in plan.for_shard(s)]
        assert lengths == sorted(lengths, reverse=True)


def test_sample_longer_than_batch_budget_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        make_plan([10, 5000], max_tokens_per_batch=4096, max_rows=8, shards=1)


def test_fingerprint_changes_names_each_difference():
    lines = fingerprint_changes(
        {"layer_ids": [1, 2], "dtype": "bfloat16"}, {"layer_ids": [2, 3], "dtype": "bfloat16"}
    )
    assert lines == ["layer_ids: [1, 2] -> [2, 3]"]


def test_plan_hash_is_the_documented_digest_and_computed_once(monkeypatch):
    import hashlib
    import json
    from dataclasses import asdict

    import hsextract.output.plan as plan_module

    plan = make_plan(
        realistic_lengths(3000), max_tokens_per_batch=16384, max_rows=64, shards=3, fingerprint={"a": 1}
    )
    body = {"format": 1, "fingerprint": {"a": 1}, "shards": 3, "batches": [asdict(b) for b in plan.batches]}
    expected = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    dumps = []
    monkeypatch.setattr(
        plan_module.json, "dumps", lambda *a, **k: dumps.append(1) or json.JSONEncoder(**k).encode(*a)
    )
    assert [plan.plan_hash for _ in range(5)] == [expected] * 5
    assert len(dumps) == 1
    assert Plan.from_json(plan.to_json()).plan_hash == expected


def reference_plan(lengths, *, max_tokens_per_batch, max_rows, shards):
    """The planner as it was first written, one sample at a time (what the batch-at-a-time one must reproduce)."""
    import heapq

    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable").tolist()
    groups, current = [], []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and ((len(current) + 1) * longest > max_tokens_per_batch or len(current) >= max_rows):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    load = [(0, s) for s in range(shards)]
    heapq.heapify(load)
    batches = []
    for batch_id, group in enumerate(groups):
        tokens, shard = heapq.heappop(load)
        batches.append((batch_id, shard, tuple(group), lengths[group[0]], sum(lengths[i] for i in group)))
        heapq.heappush(load, (tokens + len(group) * lengths[group[0]], shard))
    return batches


@pytest.mark.parametrize(
    "samples, max_tokens, max_rows, shards",
    [(1, 64, 1, 1), (7, 16, 3, 2), (5000, 4096, 64, 3), (20_000, 65536, 512, 8), (20_000, 8192, 7, 5)],
)
def test_the_plan_is_the_one_a_sample_at_a_time_planner_makes(samples, max_tokens, max_rows, shards):
    rng = np.random.default_rng(samples)
    lengths = (
        np.clip(rng.lognormal(np.log(max_tokens / 16), 1.0, samples), 1, max_tokens).astype(int).tolist()
    )
    lengths[len(lengths) // 2] = max_tokens  # a sample that fills a batch alone
    plan = make_plan(lengths, max_tokens_per_batch=max_tokens, max_rows=max_rows, shards=shards)
    got = [(b.batch_id, b.shard, b.sample_indices, b.padded_length, b.num_tokens) for b in plan.batches]
    assert got == reference_plan(lengths, max_tokens_per_batch=max_tokens, max_rows=max_rows, shards=shards)
    assert all(
        type(x) is int for b in plan.batches for x in (b.padded_length, b.num_tokens, *b.sample_indices)
    )


def test_grouped_plan_keeps_each_group_in_one_batch_and_cuts_only_a_group_too_large():
    # Groups: 0 (3 rows), 1 (2 rows), 2 (5 rows of 30: 150 tokens, more than a batch), 3 (1 row).
    groups = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3]
    lengths = [10, 20, 30, 40, 5, 30, 30, 30, 30, 30, 7]
    plan = make_plan(lengths, max_tokens_per_batch=100, max_rows=4, shards=2, groups=groups)
    batches = sorted(plan.batches, key=lambda b: b.batch_id)
    assert [b.sample_indices for b in batches] == [(0, 1, 2), (3, 4), (5, 6, 7), (8, 9, 10)]
    assert all(b.num_tokens <= 100 and b.rows <= 4 for b in batches)
    assert [b.padded_length for b in batches] == [30, 40, 30, 30]
    assert sorted(i for b in batches for i in b.sample_indices) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="2 group numbers for 3 samples"):
        make_plan([1, 2, 3], max_tokens_per_batch=10, max_rows=4, shards=1, groups=[0, 1])
