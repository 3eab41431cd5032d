"""The training loader's order (training/order.py) and its refusals, without an output."""

import pytest

from hsextract.errors import HsextractError
from hsextract.training.order import epoch_order, rank_sequence, worker_share
from hsextract.training.schemas import get_schema

FILES = [list(range(a, a + n)) for a, n in ((0, 5), (5, 1), (6, 7), (13, 3), (16, 4), (20, 6))]


def test_epoch_order_serves_each_sample_once_and_keeps_windows_of_files_together():
    order = epoch_order(FILES, shuffle=True, seed=3, epoch=0, window_files=2)
    assert sorted(order) == list(range(26))
    file_of = {i: f for f, samples in enumerate(FILES) for i in samples}
    # The order is three runs, each exactly the samples of two whole files.
    pos, windows = 0, 0
    while pos < len(order):
        end = next(
            e
            for e in range(pos + 1, len(order) + 1)
            if len(files := {file_of[i] for i in order[pos:e]}) == 2
            and sum(len(FILES[f]) for f in files) == e - pos
        )
        pos, windows = end, windows + 1
    assert windows == 3


def test_epoch_order_is_deterministic_per_seed_and_differs_per_epoch():
    a = epoch_order(FILES, shuffle=True, seed=1, epoch=0, window_files=3)
    assert a == epoch_order(FILES, shuffle=True, seed=1, epoch=0, window_files=3)
    assert a != epoch_order(FILES, shuffle=True, seed=1, epoch=1, window_files=3)
    assert a != epoch_order(FILES, shuffle=True, seed=2, epoch=0, window_files=3)
    assert epoch_order(FILES, shuffle=False, seed=1, epoch=5, window_files=3) == list(range(26))


def test_ranks_and_workers_partition_the_order():
    order = epoch_order(FILES, shuffle=True, seed=0, epoch=0, window_files=2)
    seen = []
    for rank in range(3):
        seq = rank_sequence(order, rank, 3)
        shares = [worker_share(seq, w, 2, 4) for w in range(2)]
        # An in-order DataLoader takes batch k (4 items) from worker k % 2: that is the sequence again.
        chunks = [[s[i : i + 4] for i in range(0, len(s), 4)] for s in shares]
        delivered = [x for k in range(max(map(len, chunks))) for c in chunks if k < len(c) for x in c[k]]
        assert delivered == seq
        seen += seq
    assert sorted(seen) == list(range(26))


def test_unknown_schema_is_refused_with_the_known_ones():
    with pytest.raises(HsextractError, match="not one of raw, specforge-dflash"):
        get_schema("eagle4")
