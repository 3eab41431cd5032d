"""training/reads.py: which samples share a read, and the order, errors and memory bound of reading ahead.

The planner is checked on sequences whose answer is known by construction (rows of files with given token spans);
``read_ahead`` with a fetch that records what it was asked, so the sample order, the held samples and where an
error surfaces are observed, not assumed.
"""

from __future__ import annotations

import threading

import pytest

from hsextract.errors import CorruptOutputError
from hsextract.training.order import epoch_order
from hsextract.training.reads import GAP_RATIO, plan_reads, read_ahead, shared_memory

# Two files of 10 rows of 10 tokens each, except row 4 of file "b": 1 token. SPANS: each row's tokens in its file.
LENGTHS = {"a": [10] * 10, "b": [10, 10, 10, 10, 1, 10, 10, 10, 10, 10]}
SPANS = {
    (key, r): (sum(lengths[:r]), sum(lengths[: r + 1])) for key, lengths in LENGTHS.items() for r in range(10)
}
SAMPLES = list(SPANS)  # sample i is SAMPLES[i]


def where(i):
    key, row = SAMPLES[i]
    return (key, row, *SPANS[SAMPLES[i]])


def sample(key, row):
    return SAMPLES.index((key, row))


def plan(keys_rows, horizon=16, max_tokens=1000):
    sequence = [sample(k, r) for k, r in keys_rows]
    return [
        (r.key, sorted(r.rows)) for r in plan_reads(sequence, where, horizon=horizon, max_tokens=max_tokens)
    ]


def test_adjacent_rows_of_a_file_share_a_read_in_any_order_and_files_stay_apart():
    got = plan([("a", 3), ("b", 0), ("a", 2), ("a", 4), ("b", 1), ("a", 9)])
    assert got == [("a", [2, 3, 4]), ("b", [0, 1]), ("a", [9])]


def test_a_gap_is_read_only_when_small_against_what_is_asked_for():
    # a row of 10 tokens between two of 10: half of the read would be waste, two reads
    assert plan([("a", 1), ("a", 3)]) == [("a", [1]), ("a", [3])]
    # the 1-token row 4 of "b": skipped over once 1 token is at most 1/GAP_RATIO of the tokens asked for
    assert GAP_RATIO <= 50 and GAP_RATIO > 20
    assert plan([("b", 3), ("b", 5)]) == [("b", [3]), ("b", [5])]  # 1 of 21 tokens
    assert plan([("b", 0), ("b", 1), ("b", 2), ("b", 3), ("b", 5)]) == [("b", [0, 1, 2, 3, 5])]  # 1 of 51


def test_a_read_is_bounded_in_tokens_and_in_how_far_its_samples_lie_apart():
    assert plan([("a", r) for r in range(6)], max_tokens=30) == [("a", [0, 1, 2]), ("a", [3, 4, 5])]
    # row 1 comes 3 positions after row 0: past a horizon of 2 it starts a read of its own
    far = [("a", 0), ("b", 7), ("b", 9), ("a", 1)]
    assert plan(far, horizon=2) == [("a", [0]), ("b", [7]), ("b", [9]), ("a", [1])]
    assert plan(far, horizon=4)[0] == ("a", [0, 1])


def test_every_sample_is_planned_once():
    files = [[sample("a", r) for r in range(10)], [sample("b", r) for r in range(10)]]
    sequence = epoch_order(files, shuffle=True, seed=3, epoch=0, window_files=2).tolist()
    reads = list(plan_reads(sequence, where, horizon=8, max_tokens=1000))
    positions = sorted(p for r in reads for p in r.positions)
    assert positions == list(range(len(sequence)))
    assert [r.first for r in reads] == sorted(r.first for r in reads)  # issued in the order they are due


class Fetches:
    """A fetch that answers from SAMPLES and records each call and the samples it handed out."""

    def __init__(self, bad=()):
        self.calls, self.bad, self.fetched = [], set(bad), 0
        self.lock = threading.Lock()

    def __call__(self, key, rows):
        assert rows == sorted(rows)
        with self.lock:
            self.calls.append((key, rows))
            self.fetched += len(rows)
        return {
            r: CorruptOutputError("out", key, f"row {r} bad") if (key, r) in self.bad else (key, r)
            for r in rows
        }


def stream(sequence, fetch, prefetch=4, threads=2, horizon=None):
    reads = plan_reads(sequence, where, horizon=horizon or prefetch, max_tokens=1000)
    return read_ahead(sequence, reads, fetch, lambda i, s: (i, s), threads=threads, prefetch=prefetch)


def test_samples_come_in_sequence_order_and_each_is_fetched_once():
    files = [[sample("a", r) for r in range(10)], [sample("b", r) for r in range(10)]]
    sequence = epoch_order(files, shuffle=True, seed=1, epoch=0, window_files=2).tolist()
    fetch = Fetches()
    got = list(stream(sequence, fetch))
    assert [i for i, _ in got] == sequence
    assert all(s == SAMPLES[i] for i, s in got)
    assert fetch.fetched == len(sequence)


def test_held_samples_stay_within_prefetch_and_one_read():
    sequence = [sample("a", r) for r in range(10)] + [sample("b", r) for r in range(10)]
    fetch = Fetches()
    held = []
    for k, _ in enumerate(stream(sequence, fetch, prefetch=3, threads=1)):
        held.append(fetch.fetched - k)  # fetched, not yet consumed (this one included)
    assert max(held) <= 3 + 2  # prefetch, plus the rest of a read of up to 3 (horizon = prefetch)


def test_a_bad_sample_raises_at_its_turn_after_the_good_ones_of_its_read():
    sequence = [sample("a", r) for r in range(5)]
    fetch = Fetches(bad={("a", 2)})
    got = []
    with pytest.raises(CorruptOutputError, match="row 2 bad"):
        for _, s in stream(sequence, fetch, prefetch=8):
            got.append(s)
    assert fetch.calls == [("a", [0, 1, 2, 3, 4])]  # one read for all five
    assert got == [("a", 0), ("a", 1)]


def test_shared_memory_is_shared_and_writable():
    buf = shared_memory(1 << 16)
    assert buf.is_shared() and buf.numel() == 1 << 16
    buf.fill_(7)
    assert int(buf.sum()) == 7 << 16
    assert shared_memory(0).numel() == 0
