"""Training datasets over an hsextract output (a directory or ``s3://bucket/prefix``), no export needed.

``StatesDataset`` (iterable, deterministic order across ranks and workers, resumable mid-epoch) and
``StatesMapDataset`` (index -> item) yield a schema's items. Every read is checked as the reader checks it:
damage raises ``CorruptOutputError``, never a silent skip. docs/TRAINING.md shows them in use.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from hsextract.errors import HsextractError
from hsextract.training.follow import Follow
from hsextract.training.index import SampleIndex, SampleReader, Where, index_where
from hsextract.training.order import ORDER, epoch_order, rank_sequence, worker_share
from hsextract.training.schemas import Schema, get_schema
from hsextract.training.state import (
    StateError,
    anything,
    as_state,
    check_state,
    count,
    flag,
    is_int,
    sealed,
    seconds,
    whole,
)

log = logging.getLogger(__name__)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """From the arguments, else ``torch.distributed``, else ``RANK``/``WORLD_SIZE``, else a single rank."""
    if (rank is None) != (world_size is None):
        raise HsextractError(f"give rank and world_size together (got rank={rank}, world_size={world_size})")
    if rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
            if not (rank.isdigit() and world_size.isdigit()):
                raise HsextractError(
                    f"RANK={rank!r} and WORLD_SIZE={world_size!r} in the environment must be whole numbers"
                )
            rank, world_size = int(rank), int(world_size)
    rank, world_size = whole("rank", rank, 0), whole("world_size", world_size, 1)
    if not 0 <= rank < world_size:
        raise HsextractError(f"rank {rank} is not in 0..{world_size - 1} (world_size {world_size})")
    return rank, world_size


def _where(
    output, endpoint_url, verify, dtype, cache_dir, cache_max_gb, layers=None, retry_deadline_s=120
) -> Where:
    """Where to read, from a dataset's arguments (each checked by ``Where``)."""
    if not isinstance(output, (str, os.PathLike)):
        raise HsextractError(f"output must be a directory or s3:// URL, got {output!r}")
    if cache_dir is not None and isinstance(cache_dir, os.PathLike):
        cache_dir = os.fspath(cache_dir)
    return Where(str(output), endpoint_url, verify, dtype, retry_deadline_s, cache_dir, cache_max_gb, layers)


class _Reading:
    """This process's reader of the index, opened again after a fork."""

    index: SampleIndex
    _reader: SampleReader | None = None

    def reader(self) -> SampleReader:
        if self._reader is None or self._reader.pid != os.getpid():
            self._reader = SampleReader(self.index)
        return self._reader

    def __getstate__(self):
        return {**self.__dict__, "_reader": None}

    @property
    def lengths(self) -> list[int]:
        """Every sample's token count, known without reading a state."""
        return self.index.lengths

    @property
    def sample_ids(self) -> list[str]:
        return self.index.sample_ids


class StatesMapDataset(_Reading, Dataset):
    """Index -> item over an output, for trainers that bring their own sampler. Index ``i`` is the ``i``-th sample
    the schema serves, in manifest order; ``lengths[i]`` its token count. ``layers`` as ``StatesDataset``'s."""

    def __init__(
        self,
        output,
        schema: str | Schema = "raw",
        *,
        endpoint_url: str | None = None,
        verify: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        index: SampleIndex | None = None,
        cache_dir: str | None = None,
        cache_max_gb: float = 100.0,
        layers=None,
        retry_deadline_s: float = 120,
    ):
        where = _where(output, endpoint_url, verify, dtype, cache_dir, cache_max_gb, layers, retry_deadline_s)
        self.index = index or index_where(where, schema)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self.index):
            raise IndexError(f"sample {i} is not in this dataset of {len(self.index)} samples")
        return self.reader().item(i)

    def record(self, i: int) -> dict:
        """Sample ``i`` as the trainer's offline file holds it (the item before the trainer's own dataset step)."""
        return self.reader().record(i)


class StatesDataset(_Reading, IterableDataset):
    """Every sample of an output once per epoch across ``world_size`` ranks and their DataLoader workers.

    ``batch_size`` must be the DataLoader's (1 with ``batch_size=None``): it deals the rank's sequence to the
    workers in the chunks the DataLoader batches, so resume is exact. ``window_files`` bounds the shuffle's reach
    (and the open files); ``threads`` and ``prefetch`` bound the reads in flight and the samples held.

    ``follow=True``: the output may still be written; batches are served as their completion records appear, every
    ``poll_s`` seconds, and the epoch ends once the manifest is there and everything is served (follow.py);
    ``follow_timeout_s`` without a new batch raises. Lengths and the sequence are then not known in advance.

    ``cache_dir``: what is read lands in a local disk cache of at most ``cache_max_gb`` (shared by the ranks and
    workers of a node), from which later epochs read (storage/cache.py): for many epochs from S3.
    ``retry_deadline_s``: how long a read from S3 retries an unreachable server before it raises.

    ``layers``: the stored layers each item holds, in this order: ids (``[5, 19, 33, 47, 61]``) or a preset the
    output records (``"dflash2"``). By default every captured layer, or from an output of several presets the
    schema's own (``specforge-dflash`` reads ``dflash``'s)."""

    def __init__(
        self,
        output,
        schema: str | Schema = "raw",
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        batch_size: int = 1,
        window_files: int = 8,
        threads: int = 4,
        prefetch: int = 16,
        endpoint_url: str | None = None,
        verify: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        index: SampleIndex | None = None,
        follow: bool = False,
        poll_s: float = 5.0,
        follow_timeout_s: float = 1800.0,
        cache_dir: str | None = None,
        cache_max_gb: float = 100.0,
        layers=None,
        retry_deadline_s: float = 120,
    ):
        batch_size, window_files = whole("batch_size", batch_size, 1), whole("window_files", window_files, 1)
        threads, prefetch = whole("threads", threads, 1), whole("prefetch", prefetch, 1)
        if prefetch < threads:
            raise HsextractError(f"prefetch ({prefetch}) must be at least threads ({threads})")
        if not is_int(seed):
            raise HsextractError(f"seed must be an integer, got {seed!r}")
        shuffle, follow = flag("shuffle", shuffle), flag("follow", follow)
        poll_s, follow_timeout_s = seconds("poll_s", poll_s), seconds("follow_timeout_s", follow_timeout_s)
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.follow: Follow | None = None
        where = _where(output, endpoint_url, verify, dtype, cache_dir, cache_max_gb, layers, retry_deadline_s)
        if follow:
            self.follow = Follow(
                where,
                get_schema(schema),
                rank=self.rank,
                world_size=self.world_size,
                poll_s=poll_s,
                timeout_s=follow_timeout_s,
            )
        else:
            self.index = index or index_where(where, schema)
        self.shuffle, self.seed, self.batch_size = shuffle, int(seed), batch_size
        self.window_files, self.threads, self.prefetch = window_files, threads, prefetch
        self.epoch = 0
        self._skip = 0  # samples of this rank's sequence already consumed this epoch (resume)
        self._served = 0  # counted here when iterated without DataLoader workers

    # -- the order -----------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Serve epoch ``epoch`` next (call before iterating, as with ``DistributedSampler``)."""
        epoch = whole("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch, self._skip, self._served = epoch, 0, 0
            if self.follow is not None:
                self.follow.new_epoch()

    def rank_sequence(self) -> list[int]:
        """This rank's samples for the current epoch, in the order its DataLoader delivers them."""
        return self._rank_order().tolist()

    def _rank_order(self) -> np.ndarray:
        if self.follow is not None:
            raise HsextractError(
                "a followed dataset's order depends on when batches complete: it has no sequence"
            )
        files = [self.index.file_samples[k] for k in self.index.file_keys]
        order = epoch_order(
            files, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch, window_files=self.window_files
        )
        return rank_sequence(order, self.rank, self.world_size)

    def __len__(self) -> int:
        """This rank's samples per epoch."""
        if self.follow is not None:
            return len(self.follow)
        n = len(self.index)
        return n // self.world_size + (self.rank < n % self.world_size)

    # -- resume --------------------------------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict:
        """Where this rank stands: ``consumed`` samples taken from its DataLoader since this iteration began (count
        them in the training loop; a resumed iteration counts from the resume point; without workers the dataset
        counts them itself). DataLoader workers copy the dataset at each iteration: leave persistent_workers off."""
        if self.follow is not None:
            return self.follow.state_dict(self, self._served if consumed is None else consumed)
        if consumed is not None:
            consumed = whole("consumed", consumed, 0)
        done = self._skip + self._served if consumed is None else self._skip + consumed
        return sealed(
            {"epoch": self.epoch, "consumed": done, "batch_size": self.batch_size, **self._identity()}
        )

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` stood: the next iteration serves exactly the rest of that epoch. Every field
        is checked (state.py): a state that does not fit raises ``StateError`` naming the field."""
        as_state(state, "StatesDataset")
        if self.follow is not None:
            self.follow.load_state_dict(self, state)
            self._served = 0
            return
        if state.get("follow"):
            raise HsextractError("this state was taken with follow=True: resume it with follow=True")
        if "order" not in state:
            raise StateError(
                "order",
                f"missing: the state was saved by an hsextract that served another order (this one serves "
                f"{ORDER!r}), so its place in epoch {state.get('epoch')!r} cannot be found here: call "
                "set_epoch(epoch + 1) instead of loading it, or serve that epoch again from its start",
            )
        mine = self._identity()
        fields = {
            "epoch": count(0),
            "consumed": count(0, len(self)),  # this rank's share of the epoch
            "batch_size": count(1),
            **dict.fromkeys(mine, anything),
        }
        check_state(state, fields, mine, "StatesDataset")
        self.epoch, self._skip, self._served = state["epoch"], state["consumed"], 0

    def _identity(self) -> dict:
        """The fields a state must share with the dataset that resumes it; ``order`` names the epoch order, so
        that a state of another order is refused instead of resumed at the wrong place."""
        return {
            "order": ORDER,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "window_files": self.window_files,
            "num_samples": len(self.index),
        }

    # -- reading -------------------------------------------------------------------------------------------------
    def __iter__(self):
        if self.follow is not None:
            count = get_worker_info() is None
            for item in self.follow.items(self):
                self._served += count
                yield item
            return
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        # Only this worker's share is kept (the whole order is freed here): a few MB per worker at 1M samples.
        mine = worker_share(self._rank_order()[self._skip :], worker, workers, self.batch_size)
        served = self.index.schema.served
        for item in self.reader().stream(
            mine, lambda i, s: served(s), threads=self.threads, prefetch=self.prefetch
        ):
            if info is None:
                self._served += 1
            yield item
