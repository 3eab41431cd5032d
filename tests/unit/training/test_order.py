"""The training loader's order (training/order.py) and its refusals, without an output."""

import hashlib
import random

import numpy as np
import pytest

from hsextract.errors import HsextractError
from hsextract.training.order import epoch_order, rank_sequence, worker_share
from hsextract.training.schemas import get_schema

FILES = [list(range(a, a + n)) for a, n in ((0, 5), (5, 1), (6, 7), (13, 3), (16, 4), (20, 6))]


def test_epoch_order_serves_each_sample_once_and_keeps_windows_of_files_together():
    order = epoch_order(FILES, shuffle=True, seed=3, epoch=0, window_files=2).tolist()
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
    def order(**options):
        return epoch_order(
            FILES, **{"shuffle": True, "seed": 1, "epoch": 0, "window_files": 3, **options}
        ).tolist()

    a = order()
    assert a == order()
    assert a != order(epoch=1)
    assert a != order(seed=2)
    assert order(shuffle=False, epoch=5) == list(range(26))


def test_the_epoch_order_is_the_one_recorded_for_its_seed():
    """The order is a resume state's meaning: one computed on another machine or numpy must be this one (a change
    of the algorithm must change ``order.ORDER``, which refuses the states of the old one)."""
    files = [list(range(a, a + 3)) for a in range(0, 12, 3)]
    assert epoch_order(files, shuffle=True, seed=7, epoch=2, window_files=2).tolist() == [
        3, 7, 5, 8, 6, 4, 11, 9, 1, 2, 10, 0
    ]  # fmt: skip


def reference_epoch_order(files, seed, epoch, window_files):
    """order.py's rule, one window at a time in Python: files sorted by one raw PCG64 key each, then each window's
    samples by one key each, drawn in the permuted files' order."""
    digest = hashlib.sha256(f"hsextract-epoch:{seed}:{epoch}".encode()).digest()
    bits = np.random.PCG64(np.random.SeedSequence(int.from_bytes(digest, "little")))
    file_keys = bits.random_raw(len(files)).tolist()
    permuted = sorted(range(len(files)), key=lambda f: (file_keys[f], f))
    keys = iter(bits.random_raw(sum(map(len, files))).tolist())
    order = []
    for w in range(0, len(permuted), window_files):
        window = [
            (next(keys), k, i)
            for k, i in enumerate(i for f in permuted[w : w + window_files] for i in files[f])
        ]
        order += [i for _, _, i in sorted(window)]
    return order


@pytest.mark.parametrize("samples, window_files", [(1, 1), (26, 2), (1000, 3), (4321, 8), (4321, 1000)])
@pytest.mark.parametrize("seed, epoch", [(0, 0), (-3, 7)])
def test_the_epoch_order_follows_its_rule_at_any_size(samples, window_files, seed, epoch):
    files = random_files(samples)
    got = epoch_order(files, shuffle=True, seed=seed, epoch=epoch, window_files=window_files).tolist()
    assert got == reference_epoch_order(files, seed, epoch, window_files)


def test_each_window_is_a_uniform_permutation_of_its_samples():
    """Over many seeds every sample of a window holds every place of it about equally often."""
    files, seeds = [list(range(4)), list(range(4, 8))], 4000
    counts = np.zeros((8, 8))
    for seed in range(seeds):
        order = epoch_order(files, shuffle=True, seed=seed, epoch=0, window_files=2)
        counts[order, np.arange(8)] += 1
    assert np.abs(counts / seeds - 1 / 8).max() < 0.03  # ~6 standard deviations of a fair count


def random_files(samples: int) -> list[list[int]]:
    """``samples`` sample indices in files of 1 to 40."""
    rng = random.Random(samples)
    files, start = [], 0
    while start < samples:
        n = min(samples - start, rng.randint(1, 40))
        files.append(list(range(start, start + n)))
        start += n
    return files


def reference_rank_sequence(order, rank, world_size):
    """The dealing to ranks as it was written first, in Python lists (what the arrays must reproduce)."""
    return order[rank::world_size]


def reference_worker_share(sequence, worker, num_workers, batch_size):
    return [x for j, x in enumerate(sequence) if (j // batch_size) % num_workers == worker]


@pytest.mark.parametrize("samples, window_files", [(1, 1), (26, 2), (1000, 3), (4321, 8)])
def test_ranks_and_workers_get_what_the_list_dealing_gave(samples, window_files):
    order = epoch_order(random_files(samples), shuffle=True, seed=5, epoch=1, window_files=window_files)
    for world_size in (1, 3, 8):
        for rank in {0, world_size // 2, world_size - 1}:
            seq = rank_sequence(order, rank, world_size)
            assert seq.tolist() == reference_rank_sequence(order.tolist(), rank, world_size)
            for workers, batch_size in ((1, 1), (2, 1), (3, 4), (4, 7)):
                for worker in range(workers):
                    got = worker_share(seq, worker, workers, batch_size).tolist()
                    assert got == reference_worker_share(seq.tolist(), worker, workers, batch_size)


def test_ranks_and_workers_partition_the_order():
    order = epoch_order(FILES, shuffle=True, seed=0, epoch=0, window_files=2).tolist()
    seen = []
    for rank in range(3):
        seq = rank_sequence(order, rank, 3)
        shares = [worker_share(seq, w, 2, 4).tolist() for w in range(2)]
        # An in-order DataLoader takes batch k (4 items) from worker k % 2: that is the sequence again.
        chunks = [[s[i : i + 4] for i in range(0, len(s), 4)] for s in shares]
        delivered = [x for k in range(max(map(len, chunks))) for c in chunks if k < len(c) for x in c[k]]
        assert delivered == seq
        seen += seq
    assert sorted(seen) == list(range(26))


def test_unknown_schema_is_refused_with_the_known_ones():
    with pytest.raises(HsextractError, match="not one of raw, specforge-dflash"):
        get_schema("eagle4")
