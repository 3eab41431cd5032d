"""The order samples are served in: a pure function of the index, the seed and the epoch.

Batch files are permuted and cut into windows whose samples are permuted among themselves, so reads stay local;
the order is dealt to ranks and then to DataLoader workers in the order an in-order DataLoader takes them, so a
resume needs only how many samples a rank consumed. Every worker computes the order itself, with numpy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ORDER = "pcg64-windows"


def epoch_order(
    file_samples: Sequence[Sequence[int]], *, shuffle: bool, seed: int, epoch: int, window_files: int
) -> np.ndarray:
    """Every sample index once: ``file_samples[f]`` are the indices of file ``f`` (in manifest order)."""
    if not shuffle:
        return _concatenate(file_samples)
    digest = hashlib.sha256(f"hsextract-epoch:{seed}:{epoch}".encode()).digest()
    bits = np.random.PCG64(np.random.SeedSequence(int.from_bytes(digest, "little")))
    files = np.argsort(bits.random_raw(len(file_samples)), kind="stable")
    order = _concatenate([file_samples[f] for f in files])
    # One window at a time, in place: a worker holds the order and one window's keys, no copy of the order.
    at = 0
    for w in range(0, len(files), window_files):
        n = sum(len(file_samples[f]) for f in files[w : w + window_files])
        window = order[at : at + n]
        window[:] = window[np.argsort(bits.random_raw(n), kind="stable")]
        at += n
    return order


def _concatenate(file_samples: Sequence[Sequence[int]]) -> np.ndarray:
    return np.concatenate([np.asarray(s, dtype=np.int64) for s in file_samples] or [np.zeros(0, np.int64)])


def rank_sequence(order: Sequence[int], rank: int, world_size: int) -> Sequence[int]:
    return order[rank::world_size]


def worker_share(sequence: Sequence[int], worker: int, num_workers: int, batch_size: int) -> np.ndarray:
    """Chunk ``c`` of ``batch_size`` items of the sequence goes to worker ``c % num_workers``."""
    sequence = np.asarray(sequence, dtype=np.int64)
    chunk = np.arange(len(sequence), dtype=np.int64) // batch_size
    return sequence[chunk % num_workers == worker]
