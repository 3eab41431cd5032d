"""A bounded local disk cache of an output's batch files, in blocks, for training many epochs from S3.

``CachedSink(sink, cache_dir, ...)`` serves ``read_range`` and ``get_bytes`` of the objects it is told the version
of (the manifest's batch files and final norm: ``version(key)`` gives a tag of their content and their size) from
blocks of ``BLOCK_BYTES`` on local disk; everything else (the manifest, listings) goes to the sink. A read needs the
blocks its range touches; the missing ones are fetched in one ranged read per run of consecutive blocks and stored,
so the first epoch costs the reads it would cost anyway (rounded out to whole blocks) and later epochs read local
files. Blocks, not exact ranges: a later epoch's reads need not be the same ranges as the first one's (another
rank's share, or reads of several samples at once), yet any byte read once is there.

Layout: ``cache_dir/<output id>/<key>/<tag>/<block>``, the output id a hash of the endpoint and URL, the tag the
file's recorded size and CRC32: a file rewritten with other content has another tag and never meets the old blocks.
Each block file is the block's bytes followed by their xxh3_64 (8 bytes), written under a temporary name and renamed
(storage/fileio.py): a block file is complete. A block whose bytes do not match its checksum, or of the wrong size,
is deleted and fetched again (logged); the reader's own checks then run on the bytes as on any others, so nothing
damaged on local disk reaches a trainer. No fsync: a block torn by a crash fails its checksum and is fetched again.

The limit (``max_bytes``) is kept by a byte count in ``cache_dir/usage`` that every process sharing the cache (ranks
and their DataLoader workers) updates under a file lock before it stores a block; the count is made by walking the
directory when the file is missing. When a block does not fit, the blocks of other outputs and stale versions are
removed, least recently used output first; this output's own blocks stay, and what does not fit is read through
without being stored. For a shuffled multi-epoch run over more data than the cache holds, keeping the first blocks
gives the hit rate LRU would (the cache's share of the data) without rewriting the cache every epoch.

This module imports no torch (storage/ runs in the uploader too), only the sink it wraps.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import xxhash

from hsextract.errors import HsextractError
from hsextract.storage.base import Sink
from hsextract.storage.fileio import TMP_MARK, atomic_write

log = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20

"""1 MiB: a sample's states are many blocks (one ranged read fetches them all); its token ids a fraction of one,
shared with its neighbours'."""


_DIGEST = 8


def _digest(data) -> bytes:
    return xxhash.xxh3_64(data).digest()


class CachedSink:
    """Reads of ``sink`` through the block cache in ``cache_dir``; ``version(key)`` is ``(tag, size)`` for an
    object that may be cached (its content never changes under that tag), None for one that must be read afresh.
    Every other attribute is the sink's."""

    def __init__(
        self,
        sink,
        cache_dir: str | os.PathLike[str],
        max_bytes: int,
        version: Callable[[str], tuple[str, int] | None],
        *,
        identity: str | None = None,
    ):
        if max_bytes <= 0:
            raise HsextractError(f"a cache needs room: its limit is {max_bytes} bytes")
        self.sink, self.version, self.max_bytes = sink, version, max_bytes
        self.cache_dir = Path(cache_dir)
        output_id = hashlib.sha256((identity or sink.url).encode()).hexdigest()[:16]
        self.root = self.cache_dir / output_id
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            os.utime(self.root)  # the output's last use, for removing other outputs' blocks first
        except OSError as e:
            raise HsextractError(f"cannot keep a cache in {self.cache_dir}: {e}") from None
        self._usage = _Usage(self.cache_dir)
        self._full = False  # no room left for this output: read through from now on

    def __getattr__(self, name):
        # Everything but reads is the sink's. A read this class does not define must not slip past the cache.
        if name == "sink" or name.startswith(("read", "get")):
            raise AttributeError(
                f"{type(self).__name__} has no {name}: reads of a cached sink go through the cache"
            )
        return getattr(self.sink, name)

    # -- reads ----------------------------------------------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        v = self.version(key)
        if v is None:
            return self.sink.get_bytes(key)
        return bytes(self.read_range(key, 0, v[1]))

    def read_range(self, key: str, offset: int, length: int):
        v = self.version(key)
        if v is None or length <= 0 or offset >= v[1]:
            return self.sink.read_range(key, offset, length)
        tag, size = v
        end = min(offset + length, size)
        out = bytearray(end - offset)
        first, last = offset // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        missing: list[int] = []
        for b in range(first, last + 1):
            data = self._load(key, tag, size, b)
            if data is None:
                missing.append(b)
            else:
                _copy(out, offset, b * BLOCK_BYTES, data)
        for run in _runs(missing):
            if not self._fetch(key, tag, size, run, out, offset, end):
                return self.sink.read_range(key, offset, length)  # the object is not what was recorded
        return out

    # The sink interface's default, over this cache's ``read_range`` (not the wrapped sink's own).
    read_range_into = Sink.read_range_into

    def _fetch(self, key, tag, size, run: range, out: bytearray, offset: int, end: int) -> bool:
        """Fill ``out`` from the sink over the blocks of ``run``, storing them if there is room."""
        start, stop = run.start * BLOCK_BYTES, min(run.stop * BLOCK_BYTES, size)
        store = not self._full
        if not store:  # only the bytes asked for
            start, stop = max(start, offset), min(stop, end)
        raw = self.sink.read_range(key, start, stop - start)
        if len(raw) != stop - start:
            return False
        _copy(out, offset, start, raw)
        if store:
            view = memoryview(raw)
            for b in run:
                lo = b * BLOCK_BYTES - start
                if not self._store(key, tag, b, view[lo : lo + min(BLOCK_BYTES, size - b * BLOCK_BYTES)]):
                    break
        return True

    # -- blocks ---------------------------------------------------------------------------------------------------
    def _path(self, key: str, tag: str, block: int) -> Path:
        return self.root / key / tag / f"{block:08d}"

    def _load(self, key: str, tag: str, size: int, block: int) -> bytes | None:
        path = self._path(key, tag, block)
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        data, digest = memoryview(raw)[:-_DIGEST], raw[-_DIGEST:]
        want = min(BLOCK_BYTES, size - block * BLOCK_BYTES)
        if len(raw) != want + _DIGEST or _digest(data) != digest:
            log.warning(
                "cache block %s is damaged (%d bytes, checksum mismatch): dropped, fetched again",
                path,
                len(raw),
            )
            try:
                path.unlink()
                self._usage.add(-len(raw))
            except FileNotFoundError:
                pass  # another process dropped it first
            return None
        return data

    def _store(self, key: str, tag: str, block: int, data) -> bool:
        n = len(data) + _DIGEST
        if not self._usage.reserve(n, self.max_bytes, self._evict):
            self._full = True
            log.info(
                "cache %s is full (%d bytes): further blocks of %s are read through",
                self.cache_dir,
                self.max_bytes,
                self.sink.url,
            )
            return False
        path = self._path(key, tag, block)
        try:
            atomic_write(path, lambda f: (f.write(data), f.write(_digest(data))), durable=False)
        except OSError as e:
            self._usage.add(-n)
            self._full = True
            log.warning("cache %s cannot store blocks (%s): read through from now on", self.cache_dir, e)
            return False
        return True

    def _evict(self, need: int) -> int:
        """Remove other outputs' blocks (least recently used first), then stale versions of this output's files,
        until ``need`` bytes are free; returns the bytes removed. Called with the usage lock held."""
        freed = 0
        others = [p for p in self.cache_dir.iterdir() if p.is_dir() and p != self.root]
        for path in sorted(others, key=lambda p: p.stat().st_mtime):
            if freed >= need:
                return freed
            freed += _tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
        tag_dirs = [Path(d) for d, _, files in os.walk(self.root) if any(f.isdigit() for f in files)]
        for tag_dir in tag_dirs:
            if freed >= need:
                break
            key = tag_dir.parent.relative_to(self.root).as_posix()
            current = self.version(key)
            if current is None or current[0] != tag_dir.name:
                freed += _tree_bytes(tag_dir)
                shutil.rmtree(tag_dir, ignore_errors=True)
        return freed


class _Usage:
    """The cache's size in bytes, in ``usage``, updated under the lock ``usage.lock`` by every process sharing it.
    It can only overstate (two processes storing the same block both count it): the limit holds."""

    def __init__(self, cache_dir: Path):
        self.path, self.lock = cache_dir / "usage", cache_dir / "usage.lock"

    @contextmanager
    def _locked(self):
        with open(self.lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read(self) -> int:
        try:
            return int(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return _tree_bytes(self.path.parent)

    def _write(self, used: int) -> None:
        atomic_write(self.path, str(max(0, used)), durable=False)

    def reserve(self, n: int, limit: int, evict: Callable[[int], int]) -> bool:
        with self._locked():
            used = self._read()
            if used + n > limit:
                used -= evict(used + n - limit)
            ok = used + n <= limit
            self._write(used + n if ok else used)
            return ok

    def add(self, n: int) -> None:
        with self._locked():
            self._write(self._read() + n)


def manifest_versions(manifest: dict) -> Callable[[str], tuple[str, int] | None]:
    """``version(key)`` for ``CachedSink`` from an output's manifest: the batch files by their recorded size and
    CRC32, the final norm by its size and xxh3; None for any other object. Read at each call, so entries filled in
    later (a followed output's, training/follow.py) count from then on."""
    entries = {b["key"]: b for b in manifest["batches"]}

    def version(key: str) -> tuple[str, int] | None:
        entry = entries.get(key)
        if entry is not None:
            return (f"{entry['size']}-{entry['crc32']}", entry["size"]) if "crc32" in entry else None
        norm = (manifest.get("final_state") or {}).get("norm") or {}
        if key == norm.get("key") and "xxh3" in norm:
            return f"{norm['size']}-{norm['xxh3']}", norm["size"]
        return None

    return version


def _tree_bytes(path: Path) -> int:
    """Bytes of the block files under ``path`` (the cache's own files and temporary ones not counted)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            if name.isdigit() and TMP_MARK not in name:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
    return total


def _runs(blocks: list[int]) -> list[range]:
    """Consecutive block numbers as ranges: [3, 4, 5, 9] -> [range(3, 6), range(9, 10)]."""
    runs: list[range] = []
    for b in blocks:
        if runs and runs[-1].stop == b:
            runs[-1] = range(runs[-1].start, b + 1)
        else:
            runs.append(range(b, b + 1))
    return runs


def _copy(out: bytearray, out_start: int, data_start: int, data) -> None:
    """Copy the part of ``data`` (bytes from ``data_start`` of the object) that falls in ``out`` (from
    ``out_start``)."""
    lo, hi = max(out_start, data_start), min(out_start + len(out), data_start + len(data))
    if lo < hi:
        out[lo - out_start : hi - out_start] = memoryview(data)[lo - data_start : hi - data_start]
