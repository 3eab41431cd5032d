"""The order samples are served in: a pure function of the index, the seed and the epoch.

Shuffle keeps reads local: the batch files are permuted, cut into windows of ``window_files`` consecutive files,
and the samples of each window are permuted among themselves. A window's reads touch only its files (a few GB),
whose headers stay cached; a larger window mixes more. The global order is dealt to ranks round-robin
(``order[rank::world_size]``: sizes differ by at most one), and a rank's sequence to its DataLoader workers in
chunks of ``batch_size`` round-robin, which is the order an in-order DataLoader takes batches from its workers:
the batches a rank's loader delivers are exactly its sequence in order. Resume therefore only needs how many
samples of its sequence a rank has consumed.
"""

from __future__ import annotations

import random


def epoch_order(
    file_samples: list[list[int]], *, shuffle: bool, seed: int, epoch: int, window_files: int
) -> list[int]:
    """Every sample index once: ``file_samples[f]`` are the indices of file ``f`` (in manifest order)."""
    if not shuffle:
        return [i for samples in file_samples for i in samples]
    rng = random.Random(f"hsextract-epoch:{seed}:{epoch}")
    files = list(range(len(file_samples)))
    rng.shuffle(files)
    order: list[int] = []
    for w in range(0, len(files), window_files):
        window = [i for f in files[w : w + window_files] for i in file_samples[f]]
        rng.shuffle(window)
        order.extend(window)
    return order


def rank_sequence(order: list[int], rank: int, world_size: int) -> list[int]:
    return order[rank::world_size]


def worker_share(sequence: list[int], worker: int, num_workers: int, batch_size: int) -> list[int]:
    """Chunk ``c`` of ``batch_size`` items of the sequence goes to worker ``c % num_workers``."""
    return [x for j, x in enumerate(sequence) if (j // batch_size) % num_workers == worker]
