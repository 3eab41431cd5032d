"""Reading a sequence of samples ahead of its consumer, several samples of one batch file in one ranged read.

``plan_reads`` groups samples of one file that are due close together while little of the read is unwanted rows;
``read_ahead`` runs the reads in a bounded pool and yields samples in order. A sample that fails its checksum raises
when its turn comes, as a read of it alone would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hsextract.errors import CorruptOutputError
from hsextract.output import plain_memory

if TYPE_CHECKING:
    import torch

MAX_READ_BYTES = 64 << 20

"""The largest read several samples are merged into (a sample larger than this is still one read)."""


GAP_RATIO = 32

"""At most 1/32 of a merged read is bytes of no sample asked for: bytes read stay within 3% of those served."""


@dataclass
class Read:
    """Rows of one batch file read together; ``positions`` are their samples' places in the sequence."""

    key: str
    first: int
    start: int  # the read's span in the file's tokens
    stop: int
    wanted: int = 0  # tokens of the samples asked for
    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def add(self, position: int, row: int, start: int, stop: int) -> None:
        self.start, self.stop = min(self.start, start), max(self.stop, stop)
        self.wanted += stop - start
        self.rows.append(row)
        self.positions.append(position)

    def takes(self, start: int, stop: int, max_tokens: int) -> bool:
        span = max(self.stop, stop) - min(self.start, start)
        wanted = self.wanted + stop - start
        return span <= max_tokens and (span - wanted) * GAP_RATIO <= wanted


def plan_reads(
    sequence: Sequence[int],
    where: Callable[[int], tuple[str, int, int, int]],
    *,
    horizon: int,
    max_tokens: int,
) -> Iterator[Read]:
    """The reads of ``sequence`` in the order of their first sample. ``where(i)`` says where sample ``i`` lies:
    (batch file key, row, first token, end token) within that file; ``max_tokens`` bounds a merged read."""
    open_reads: dict[str, list[Read]] = {}
    queue: deque[Read] = deque()
    for position, i in enumerate(sequence):
        while queue and position - queue[0].first >= horizon:
            done = queue.popleft()
            open_reads[done.key].remove(done)
            yield done
        key, row, start, stop = where(i)
        read = next((r for r in open_reads.get(key, ()) if r.takes(start, stop, max_tokens)), None)
        if read is None:
            read = Read(key, position, start, stop)
            queue.append(read)
            open_reads.setdefault(key, []).append(read)
        read.add(position, row, start, stop)
    yield from queue


def read_ahead(
    sequence: Sequence[int],
    reads: Iterator[Read],
    fetch: Callable[[str, list[int]], dict],
    make: Callable[[int, dict], object],
    *,
    threads: int,
    prefetch: int,
) -> Iterator:
    """``make(i, sample)`` for every ``i`` of ``sequence``, in order. ``reads`` is ``plan_reads`` of the sequence;
    ``fetch(key, rows)`` reads rows (ascending) of one file: ``{row: reader dict or CorruptOutputError}``."""

    def run(read: Read) -> list:
        order = sorted(range(len(read.rows)), key=read.rows.__getitem__)
        got = fetch(read.key, [read.rows[k] for k in order])
        out: list = [None] * len(read.rows)
        for k in order:
            s = got[read.rows[k]]
            out[k] = s if isinstance(s, CorruptOutputError) else make(sequence[read.positions[k]], s)
        return out

    with ThreadPoolExecutor(threads, thread_name_prefix="hsextract-read") as pool:
        pending: deque = deque()
        ready: dict[int, object] = {}
        held = 0  # samples of submitted reads not yet yielded
        upcoming = next(reads, None)
        try:
            for position in range(len(sequence)):
                # A read is due when there is room for it, and always once its first sample is.
                while upcoming is not None and (held < prefetch or upcoming.first <= position):
                    pending.append((upcoming, pool.submit(run, upcoming)))
                    held += len(upcoming.rows)
                    upcoming = next(reads, None)
                while position not in ready:
                    read, future = pending.popleft()
                    ready.update(zip(read.positions, future.result(), strict=True))
                item = ready.pop(position)
                held -= 1
                if isinstance(item, CorruptOutputError):
                    raise item
                yield item
        finally:
            for _, future in pending:
                future.cancel()


def shared_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of shared memory as a uint8 tensor, allocated there directly (``share_memory_()`` would allocate,
    then copy): a DataLoader worker sends a tensor in shared memory to the main process as a handle."""
    if not nbytes:
        return plain_memory(0)
    import torch

    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:
        return plain_memory(nbytes).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))
