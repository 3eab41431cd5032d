"""Which samples an output serves to a schema, and reading them from any thread.

``SampleIndex`` is built once, in the process that makes the dataset: the manifest, plus each batch file's header
and index tensors (two small reads per file, in a pool of threads) for the samples' lengths, plus, for a schema that
leaves samples out (SpecForge's DFlash), each file's token ids and loss masks (5 bytes per token). No state is read.
It holds no open connection, so it pickles into DataLoader workers, which open the output again themselves
(``SampleReader``): a boto3 client must not cross a fork.

``SampleReader`` keeps a bounded cache of open batch files (their parsed headers and index, a few KB each) shared by
its threads; a sample is one checked ranged read of its rows (reader.BatchFile), dequantized if fp8.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from torch.utils.data import get_worker_info

from hsextract.batchfile import plain_memory
from hsextract.reader import open_output
from hsextract.training.reads import MAX_READ_BYTES, plan_reads, read_ahead, shared_memory
from hsextract.training.schemas import Schema, get_schema
from hsextract.training.state import check_where

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Where:
    """How to open the output again in another process."""

    path: str
    endpoint_url: str | None
    verify: bool
    dtype: torch.dtype
    retry_deadline_s: float
    cache_dir: str | None = None
    """A local disk cache of the batch files read (storage/cache.py), for many epochs from S3."""
    cache_max_gb: float = 100.0
    layers: tuple[int, ...] | str | None = None
    """The stored layers served, in order (ids or a preset: reader.served_layers); None: every captured one."""

    def __post_init__(self):
        # Every dataset's arguments pass here: a wrong one is refused by name, not met in a worker later.
        check_where(self)


class SampleIndex:
    """The samples of an output a schema serves, in manifest order: ``keys[i]``, ``rows[i]``, ``lengths[i]``,
    ``sample_ids[i]`` for sample ``i``, ``starts[i]`` its first token in its file; ``skipped`` maps the left-out
    sample ids to the reason; ``token_bytes`` is the states' bytes per token (every file's)."""

    def __init__(self, out, where: Where, schema: Schema, threads: int = 8):
        self.where, self.schema = where, schema
        self.manifest = out.manifest
        self.layer_ids: tuple[int, ...] = out.layer_ids
        """The layer ids each item serves, in order."""
        schema.check(self.manifest, out.layer_ids)
        batches = self.manifest["batches"]
        needs_tokens = type(schema).skip_reason is not Schema.skip_reason

        def scan(batch: dict):
            f = out.open_batch_file(batch["key"])
            cu = f.cu_seqlens
            kept, skipped = [], {}
            if needs_tokens:
                ids, mask = f.read_all("input_ids"), f.read_all("loss_mask")
            for row, sid in enumerate(f.sample_ids):
                a, b = cu[row], cu[row + 1]
                reason = schema.skip_reason(ids[a:b], mask[a:b]) if needs_tokens else None
                if reason:
                    skipped[sid] = reason
                else:
                    kept.append((row, sid, a, b - a))
            return batch["key"], kept, skipped, f.tensors["hidden_states"].row_bytes

        with ThreadPoolExecutor(max(1, min(threads, len(batches)))) as pool:
            scanned = list(pool.map(scan, batches))
        self.keys: list[str] = []
        self.rows: list[int] = []
        self.sample_ids: list[str] = []
        self.lengths: list[int] = []
        self.starts: list[int] = []
        self.skipped: dict[str, str] = {}
        self.file_samples: dict[str, list[int]] = {}
        self.token_bytes = max((s[3] for s in scanned), default=0)
        for key, kept, skipped, _ in scanned:
            self.file_samples[key] = []
            for row, sid, start, n in kept:
                self.file_samples[key].append(len(self.keys))
                self.keys.append(key)
                self.rows.append(row)
                self.sample_ids.append(sid)
                self.starts.append(start)
                self.lengths.append(n)
            self.skipped.update(skipped)
        self.file_keys = [b["key"] for b in batches]
        if self.skipped:
            log.info(
                "%s: %d of %d samples left out for %s (%s)",
                where.path,
                len(self.skipped),
                len(self.skipped) + len(self.keys),
                schema.name,
                next(iter(set(self.skipped.values()))),
            )

    def __len__(self) -> int:
        return len(self.keys)


def index_output(
    output,
    schema: str | Schema = "raw",
    *,
    endpoint_url: str | None = None,
    verify: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    retry_deadline_s: float = 120,
    threads: int = 8,
    cache_dir: str | None = None,
    cache_max_gb: float = 100.0,
    layers=None,
) -> SampleIndex:
    """Open ``output`` (a directory or ``s3://bucket/prefix``) and index the samples ``schema`` serves
    (``layers``: the stored layers served, in order; by default the schema's preset of a union output)."""
    where = Where(str(output), endpoint_url, verify, dtype, retry_deadline_s, cache_dir, cache_max_gb, layers)
    return index_where(where, schema, threads)


def index_where(where: Where, schema: str | Schema = "raw", threads: int = 8) -> SampleIndex:
    """The index of the output ``where`` says how to open; from a union of presets, the schema's own layers unless
    ``where`` names others (schemas.Schema.layers_for)."""
    schema = get_schema(schema)
    out = open_where(where)
    layers = schema.layers_for(out.manifest, where.layers)
    if layers != where.layers:
        where = replace(where, layers=layers)
        out = open_where(where, out.manifest)
    return SampleIndex(out, where, schema, threads)


def open_where(where: Where, manifest: dict | None = None, **options):
    """The output ``where`` says how to open (``options``: the reader's others, e.g. ``cache_files``)."""
    return open_output(
        where.path,
        where.endpoint_url,
        retry_deadline_s=where.retry_deadline_s,
        verify=where.verify,
        dtype=where.dtype,
        manifest=manifest,
        cache_dir=where.cache_dir,
        cache_max_gb=where.cache_max_gb,
        layers=where.layers,
        **options,
    )


class SampleReader:
    """Reads samples of an indexed output in this process, from any of its threads. In a DataLoader worker the
    states are read into shared memory (reads.shared_memory), elsewhere into plain memory."""

    def __init__(self, index: SampleIndex, cache_files: int = 32):
        self.index = index
        self.out = open_where(index.where, index.manifest)  # read once, where the index was made
        self.pid = os.getpid()
        self.alloc = shared_memory if get_worker_info() is not None else plain_memory
        self._files: OrderedDict = OrderedDict()
        self._cache_files = cache_files
        self._lock = threading.Lock()

    def _file(self, key: str):
        with self._lock:
            f = self._files.get(key)
            if f is not None:
                self._files.move_to_end(key)
                return f
        # Two small reads (header; index, token ids, masks); a rare duplicate open in another thread is harmless.
        f = self.out.open_batch_file(key)
        with self._lock:
            self._files[key] = f
            while len(self._files) > self._cache_files:
                self._files.popitem(last=False)
        return f

    def samples(self, key: str, rows: list[int]) -> dict:
        """Rows (ascending) of batch file ``key`` in one read of their states: ``{row: reader dict}``, or
        ``{row: CorruptOutputError}`` for a row whose bytes fail their checksum."""
        return self.out.read_samples(self._file(key), rows, self.alloc)

    def sample(self, i: int) -> dict:
        """The reader dict of sample ``i``."""
        got = self.samples(self.index.keys[i], [self.index.rows[i]])[self.index.rows[i]]
        if isinstance(got, Exception):
            raise got
        return got

    def item(self, i: int) -> dict:
        """Sample ``i`` as the schema's item (what the trainer's own dataset yields)."""
        return self.index.schema.served(self.sample(i))

    def record(self, i: int) -> dict:
        """Sample ``i`` as the schema's record (what the trainer's offline file holds)."""
        return self.index.schema.record(self.sample(i))

    def stream(self, sequence: list[int], make, *, threads: int, prefetch: int):
        """``make(i, reader dict)`` for every sample ``i`` of ``sequence``, in order, read ahead by ``threads``
        threads with at most ``prefetch`` samples held (reads.read_ahead), adjacent rows of a file in one read."""
        index = self.index
        max_tokens = MAX_READ_BYTES // max(1, index.token_bytes)

        def where(i: int):
            return index.keys[i], index.rows[i], index.starts[i], index.starts[i] + index.lengths[i]

        reads = plan_reads(sequence, where, horizon=prefetch, max_tokens=max_tokens)
        return read_ahead(sequence, reads, self.samples, make, threads=threads, prefetch=prefetch)
