"""Batches by token budget, grouped by length: a DataLoader ``batch_sampler`` over the map-style dataset.

Unlike a multipack sampler, every sample is served once per epoch and reads stay local: an epoch is a pure function
of the lengths (from the index), the seed and the epoch, cut into windows of files as order.py does; the batch
count is made a multiple of ``world_size`` because DDP needs equal steps.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from hsextract.errors import HsextractError
from hsextract.training.dataset import _rank_and_world
from hsextract.training.state import StateError, anything, check_state, count, flag, is_int, sealed, whole


def token_budget_batches(
    lengths: Sequence[int],
    files: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    window_files: int = 8,
    world_size: int = 1,
    max_samples: int | None = None,
) -> list[list[int]]:
    """Every sample index once, in batches of at most ``max_tokens`` tokens (``lengths[i]`` is sample ``i``'s),
    grouped by length; ``files[f]`` are the indices of batch file ``f``. As many batches as a multiple of
    ``world_size`` where there are enough samples to split."""
    rng = random.Random(f"hsextract-token-budget:{seed}:{epoch}")
    order = list(range(len(files)))
    if shuffle:
        rng.shuffle(order)
    batches: list[list[int]] = []
    for w in range(0, len(order), window_files):
        window = [i for f in order[w : w + window_files] for i in files[f]]
        ties = {i: rng.random() for i in window} if shuffle else {i: i for i in window}
        window.sort(key=lambda i: (-lengths[i], ties[i]))
        packed: list[list[int]] = []
        tokens = 0
        for i in window:
            if (
                packed
                and tokens + lengths[i] <= max_tokens
                and len(packed[-1]) < (max_samples or len(window))
            ):
                packed[-1].append(i)
                tokens += lengths[i]
            else:
                packed.append([i])
                tokens = lengths[i]
        if shuffle:
            rng.shuffle(packed)
        batches += packed
    while len(batches) % world_size:
        j = max(range(len(batches)), key=lambda j: len(batches[j]))
        if len(batches[j]) < 2:
            break  # fewer samples than ranks: the ranks' counts differ by one
        half = len(batches[j]) // 2
        batches[j : j + 1] = [batches[j][:half], batches[j][half:]]
    return batches


class TokenBudgetBatches:
    """A DataLoader ``batch_sampler``: this rank's batches of sample indices of ``data`` (a ``StatesMapDataset`` or
    its ``SampleIndex``) for the current epoch, each within ``max_tokens`` tokens and ``max_samples`` samples.

    ``state_dict(consumed=N)`` with N the batches this rank's loop took since its iteration began (the DataLoader
    draws batches ahead of the loop, so the loop counts them) and ``load_state_dict`` resume mid-epoch."""

    def __init__(
        self,
        data,
        max_tokens: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        window_files: int = 8,
        max_samples: int | None = None,
    ):
        index = getattr(data, "index", data)
        if not all(hasattr(index, a) for a in ("lengths", "file_samples", "file_keys")):
            raise HsextractError(
                f"data must be a StatesMapDataset or its SampleIndex, got {type(data).__name__}"
            )
        self.lengths, self.files = index.lengths, [index.file_samples[k] for k in index.file_keys]
        max_tokens, window_files = whole("max_tokens", max_tokens, 1), whole("window_files", window_files, 1)
        if max_samples is not None:
            max_samples = whole("max_samples", max_samples, 1)
        if not is_int(seed):
            raise HsextractError(f"seed must be an integer, got {seed!r}")
        shuffle = flag("shuffle", shuffle)
        too_long = [n for n in self.lengths if n > max_tokens]
        if too_long:
            raise HsextractError(
                f"{len(too_long)} of {len(self.lengths)} samples are longer than max_tokens={max_tokens} (the "
                f"longest has {max(too_long)} tokens): give max_tokens at least {max(too_long)}; every sample is "
                "served, none truncated"
            )
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.max_tokens, self.max_samples = max_tokens, max_samples
        self.seed, self.shuffle, self.window_files = seed, shuffle, window_files
        self.epoch, self._skip = 0, 0
        self._cached: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        epoch = whole("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch, self._skip = epoch, 0

    def rank_batches(self) -> list[list[int]]:
        """This rank's batches for the current epoch, in order."""
        if self._cached is None or self._cached[0] != self.epoch:
            every = token_budget_batches(
                self.lengths,
                self.files,
                self.max_tokens,
                seed=self.seed,
                epoch=self.epoch,
                shuffle=self.shuffle,
                window_files=self.window_files,
                world_size=self.world_size,
                max_samples=self.max_samples,
            )
            self._cached = (self.epoch, every[self.rank :: self.world_size])
        return self._cached[1]

    def __iter__(self) -> Iterator[list[int]]:
        yield from (list(b) for b in self.rank_batches()[self._skip :])

    def __len__(self) -> int:
        """This rank's batches per epoch."""
        return len(self.rank_batches())

    def state_dict(self, consumed: int) -> dict:
        return sealed(
            {"epoch": self.epoch, "consumed": self._skip + whole("consumed", consumed, 0), **self._identity()}
        )

    def load_state_dict(self, state: dict) -> None:
        """Every field checked (state.py): a state that does not fit raises ``StateError`` naming the field."""
        mine = self._identity()
        fields = {"epoch": count(0), "consumed": count(0), **dict.fromkeys(mine, anything)}
        check_state(state, fields, mine, "TokenBudgetBatches")
        epoch = self.epoch
        self.epoch = state["epoch"]
        if state["consumed"] > len(self):  # this rank's batches of that epoch
            problem = (
                f"{state['consumed']} is more than this rank's {len(self)} batches of epoch {self.epoch}"
            )
            self.epoch = epoch
            raise StateError("consumed", problem)
        self._skip = state["consumed"]

    def _identity(self) -> dict:
        names = ("seed", "shuffle", "rank", "world_size", "max_tokens", "max_samples", "window_files")
        return {**{name: getattr(self, name) for name in names}, "num_samples": len(self.lengths)}
