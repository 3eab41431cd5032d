"""Which samples an output serves to a schema, and reading them from any thread.

``SampleIndex`` memory-maps the output's sample index so that a node's DataLoader workers share its pages; it
pickles as a path and small arrays and holds no connection (a boto3 client must not cross a fork). An output
without the index is scanned instead. ``SampleReader`` reads a sample in one checked ranged read.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from hsextract.container import map_file
from hsextract.errors import CorruptOutputError, HsextractError
from hsextract.output import SampleTable, open_output, plain_memory
from hsextract.training.reads import MAX_READ_BYTES, plan_reads, read_ahead, shared_memory
from hsextract.training.schemas import SCHEMAS, Schema, get_schema
from hsextract.training.state import check_where

if TYPE_CHECKING:
    import torch

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


def skips_samples(schema: Schema) -> bool:
    return type(schema).skip_reason is not Schema.skip_reason


# -- building the table ---------------------------------------------------------------------------------------------
def scan_files(open_file, entries: list[dict], schemas: list[Schema], threads: int = 8):
    """The sample table of the batch files ``entries`` (manifest order), each opened by ``open_file(entry)``, with
    the verdicts of ``schemas`` (those that leave samples out) from each file's token ids and loss masks. Returns
    the table and ``{key: CorruptOutputError}`` for files that could not be read (the table is then None)."""

    def scan(entry: dict):
        try:
            f = open_file(entry)
        except CorruptOutputError as e:
            return e
        cu = f.cu_seqlens
        codes = {}
        if schemas:
            ids, mask = f.read_array("input_ids"), f.read_array("loss_mask")
            for s in schemas:
                codes[s.verdicts] = [
                    s.skip_reason(ids[a:b], mask[a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)
                ]
        return list(f.sample_ids), cu, codes, f.tensors["hidden_states"].row_bytes

    with ThreadPoolExecutor(max(1, min(threads, len(entries)))) as pool:
        scanned = list(pool.map(scan, entries))
    problems = {e["key"]: got for e, got in zip(entries, scanned, strict=True) if isinstance(got, Exception)}
    if problems:
        return None, problems
    skips = {}
    for s in schemas:
        reasons: list[str] = []
        codes: list[int] = []
        for _, _, verdicts, _ in scanned:
            for why in verdicts[s.verdicts]:
                if why and why not in reasons:
                    reasons.append(why)
                codes.append(reasons.index(why) + 1 if why else 0)
        skips[s.verdicts] = (reasons, codes)
    table = SampleTable.from_files(
        [e["key"] for e in entries],
        [(ids, cu) for ids, cu, _, _ in scanned],
        max((s[3] for s in scanned), default=0),
        skips,
    )
    return table, {}


def write_sample_index(sink, manifest: dict, threads: int = 16) -> tuple[dict | None, dict]:
    """Index every batch file the (not yet written) ``manifest`` lists, with the verdicts of every schema that
    leaves samples out, and write the index beside it. Returns the manifest's ``sample_index`` entry, or None and
    ``{key: CorruptOutputError}`` for batch files that could not be read."""
    from hsextract.output import BatchFile

    schemas = [s for s in SCHEMAS.values() if skips_samples(s)]
    table, problems = scan_files(
        lambda e: BatchFile.listed(sink, manifest, e),
        manifest["batches"],
        schemas,
        threads,
    )
    if problems:
        return None, problems
    return table.write(sink), {}


def _slim(manifest: dict) -> dict:
    """The manifest without its per-batch sample ids (the index holds them): what crosses into workers."""
    return {
        **manifest,
        "batches": [{k: v for k, v in b.items() if k != "sample_ids"} for b in manifest["batches"]],
    }


class _Column(Sequence):
    """A read-only sequence over the served samples, computed from the table on access."""

    def __init__(self, get, n: int):
        self._get, self._n = get, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._get(j) for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(f"sample {i} is not in this index of {self._n} samples")
        return self._get(i % self._n)


class SampleIndex:
    """The samples of an output a schema serves, in manifest order: ``keys[i]``, ``rows[i]``, ``lengths[i]``,
    ``sample_ids[i]`` for sample ``i``, ``starts[i]`` its first token in its file; ``file_samples[key]`` the
    range of samples of a file; ``skipped`` maps the left-out sample ids to the reason; ``token_bytes`` is the
    states' bytes per token (every file's)."""

    def __init__(self, out, where: Where, schema: Schema, threads: int = 8):
        self.where, self.schema = where, schema
        manifest = out.manifest
        self.layer_ids: tuple[int, ...] = out.layer_ids
        """The layer ids each item serves, in order."""
        schema.check(manifest, out.layer_ids)
        self.manifest = _slim(manifest)
        self.path: str | None = None
        self.extra_skips: dict[str, tuple[np.ndarray, list[str]]] = {}
        """Verdicts of a schema the index file lacks, scanned here."""
        wanted = [schema] if skips_samples(schema) else []
        entry = manifest.get("sample_index")
        if entry is None:
            log.info(
                "%s has no sample_index.safetensors (written by an hsextract before it): indexing its %d batch "
                "files, 2 reads each",
                where.path,
                len(manifest["batches"]),
            )
            self.table = self._scan(out, manifest, wanted, threads)
        else:
            self.table, self.path, copied = SampleTable.read(out.sink, entry, where.verify)
            if copied:
                weakref.finalize(self, SampleTable.remove_copy, self.path, os.getpid())
            if self.table.keys != [b["key"] for b in manifest["batches"]]:
                raise CorruptOutputError(
                    out.sink.url,
                    entry["key"],
                    "lists other batch files than the manifest; the output is damaged",
                )
            if wanted and schema.verdicts not in self.table.skips:
                log.info("%s has no verdicts for %s: indexing its batch files", entry["key"], schema.verdicts)
                scanned = self._scan(out, manifest, wanted, threads)
                self.extra_skips = {
                    schema.verdicts: (scanned.skips[schema.verdicts], scanned.skip_reasons[schema.verdicts])
                }
                self._add_skips()
        self._select()
        if self.kept is not None:
            log.info(
                "%s: %d of %d samples left out for %s (%s)",
                where.path,
                len(self.table) - len(self.kept),
                len(self.table),
                schema.verdicts,
                "; ".join(self.table.skip_reasons[schema.verdicts]),
            )

    @staticmethod
    def _scan(out, manifest: dict, schemas: list[Schema], threads: int) -> SampleTable:
        table, problems = scan_files(
            lambda e: out.open_batch_file(e["key"]), manifest["batches"], schemas, threads
        )
        if problems:
            raise next(iter(problems.values()))
        return table

    def _select(self) -> None:
        """The served samples (``kept``: positions in the table, None for all) and each file's range of them."""
        t = self.table
        codes = t.skips.get(self.schema.verdicts) if skips_samples(self.schema) else None
        self.kept = None if codes is None or not codes.any() else np.flatnonzero(codes == 0)
        bounds = t.file_first if self.kept is None else np.searchsorted(self.kept, t.file_first)
        self.file_keys = list(t.keys)
        self.file_samples = {
            k: range(a, b) for k, a, b in zip(t.keys, bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        }
        self._n = len(t) if self.kept is None else len(self.kept)
        self._rows, self._starts, self._lengths = (
            (a if self.kept is None else a[self.kept]) for a in (t.row, t.start, t.length)
        )
        self._files = t.file if self.kept is None else t.file[self.kept]

    def __len__(self) -> int:
        return self._n

    # What crosses into a DataLoader worker: a mapped index as its path (the worker maps the same file), the rest
    # as they are (small arrays; a scanned index's table).
    def __getstate__(self):
        state = {k: self.__dict__[k] for k in ("where", "schema", "manifest", "path", "extra_skips", "table")}
        if self.path is not None:
            state["table"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.table is None:
            self.table = SampleTable.decode(
                map_file(self.path), lambda problem: HsextractError(f"{self.path} {problem}")
            )
            self._add_skips()
        self._select()

    def _add_skips(self) -> None:
        for name, (codes, reasons) in self.extra_skips.items():
            self.table.skips[name], self.table.skip_reasons[name] = codes, reasons

    def where_in_file(self, i: int) -> tuple[str, int, int, int]:
        """Sample ``i``'s batch file, row, and first and last-plus-one token in the file."""
        start = int(self._starts[i])
        return self.file_keys[self._files[i]], int(self._rows[i]), start, start + int(self._lengths[i])

    @property
    def keys(self) -> Sequence[str]:
        return _Column(lambda i: self.file_keys[self._files[i]], self._n)

    @property
    def rows(self) -> Sequence[int]:
        return _Column(lambda i: int(self._rows[i]), self._n)

    @property
    def starts(self) -> Sequence[int]:
        return _Column(lambda i: int(self._starts[i]), self._n)

    @cached_property
    def lengths(self) -> list[int]:
        return self._lengths.tolist()

    @property
    def sample_ids(self) -> Sequence[str]:
        t = self.table
        return _Column(lambda i: t.sample_id(i if self.kept is None else int(self.kept[i])), self._n)

    @cached_property
    def skipped(self) -> dict[str, str]:
        if not skips_samples(self.schema) or self.kept is None:
            return {}
        codes, reasons = self.table.skips[self.schema.verdicts], self.table.skip_reasons[self.schema.verdicts]
        left_out = np.flatnonzero(codes)
        return dict(
            zip(self.table.sample_ids_at(left_out), (reasons[c - 1] for c in codes[left_out]), strict=True)
        )

    @property
    def token_bytes(self) -> int:
        return self.table.token_bytes

    def file_sample_ids(self, key: str) -> list[str]:
        """Every sample id of batch file ``key`` in row order, served or not (what its header lists)."""
        return self.table.file_sample_ids(self._file_number[key])

    @cached_property
    def _file_number(self) -> dict[str, int]:
        return {k: f for f, k in enumerate(self.file_keys)}


def index_output(
    output,
    schema: str | Schema = "raw",
    *,
    endpoint_url: str | None = None,
    verify: bool = True,
    dtype: torch.dtype | None = None,
    retry_deadline_s: float = 120,
    threads: int = 8,
    cache_dir: str | None = None,
    cache_max_gb: float = 100.0,
    layers=None,
) -> SampleIndex:
    """Open ``output`` (a directory or ``s3://bucket/prefix``) and index the samples ``schema`` serves
    (``layers``: the stored layers served, in order; by default the schema's preset of a union output)."""
    if dtype is None:
        import torch

        dtype = torch.bfloat16
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
        from torch.utils.data import get_worker_info

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
        f = self.out.open_batch_file(key, self.index.file_sample_ids(key))
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
        key, row, _, _ = self.index.where_in_file(i)
        got = self.samples(key, [row])[row]
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
        max_tokens = MAX_READ_BYTES // max(1, index.table.token_bytes)
        reads = plan_reads(sequence, index.where_in_file, horizon=prefetch, max_tokens=max_tokens)
        return read_ahead(sequence, reads, self.samples, make, threads=threads, prefetch=prefetch)
