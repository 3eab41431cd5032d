"""A bounded local disk cache of an output's batch files, in blocks, for training many epochs from S3.

Blocks are keyed by the file's recorded size and CRC32 (a rewritten file never meets old blocks) and carry their
own hash, so a torn block is fetched again without fsync; processes sharing the cache keep its limit through one
checksummed byte count under a file lock. No torch here. docs/TRAINING.md ("A local disk cache") has the user's side.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import re
import shutil
import stat
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import xxhash

from hsextract.errors import FULL_ERRNOS, HsextractError
from hsextract.storage.base import Sink
from hsextract.storage.fileio import TMP_MARK, atomic_write

log = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20

"""1 MiB: a sample's states are many blocks (one ranged read fetches them all); its token ids a fraction of one,
shared with its neighbours'."""


_DIGEST = 8


MARKER = ".hsextract-cache"

"""In every output folder the cache made: what proves a folder of ``cache_dir`` is the cache's to remove."""


USAGE, LOCK = ".hsextract-cache-usage", ".hsextract-cache-lock"


_OUTPUT_ID = re.compile(r"^[0-9a-f]{16}$")


def cache_limit(cache_max_gb) -> int:
    """``cache_max_gb`` as the cache's limit in bytes; a value that is not a positive, finite number is refused."""
    ok = isinstance(cache_max_gb, (int, float)) and not isinstance(cache_max_gb, bool)
    if not ok or not math.isfinite(cache_max_gb) or cache_max_gb * 1e9 < 1:
        raise HsextractError(
            f"cache_max_gb must be a positive, finite number of GB (decimal), got {cache_max_gb!r}"
        )
    return int(cache_max_gb * 1e9)


def _marker_text(output_id: str) -> str:
    return f"hsextract block cache of output {output_id}\n"


def owned_outputs(cache_dir: Path) -> list[Path]:
    """The output folders of ``cache_dir`` this cache made: real folders (not links) of its naming, holding a
    regular marker file that names them. Nothing else in ``cache_dir`` is the cache's."""
    found = []
    try:
        entries = list(os.scandir(cache_dir))
    except OSError:
        return found
    for entry in entries:
        if not _OUTPUT_ID.match(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        marker = Path(entry.path) / MARKER
        try:
            if not stat.S_ISREG(marker.lstat().st_mode) or marker.read_text() != _marker_text(entry.name):
                continue
        except (OSError, UnicodeDecodeError):
            continue
        found.append(Path(entry.path))
    return found


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
        self._usage = _Usage(self.cache_dir)
        self._full = False  # no room left for this output: read through from now on
        if self.root.is_symlink() or (self.root.exists() and not self.root.is_dir()):
            raise HsextractError(
                f"{self.root} is in the place of this output's cache folder but is not one the cache made (a link "
                "or a file): move it away, or give another cache_dir"
            )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            marker = self.root / MARKER
            if not marker.is_file() or marker.read_text() != _marker_text(output_id):
                # The folder's name is this output's hash: it is the cache's own (an older hsextract's, if the
                # marker is missing), now marked as such.
                atomic_write(marker, _marker_text(output_id), durable=False)
            os.utime(self.root)  # the output's last use, for removing other outputs' blocks first
        except OSError as e:
            if e.errno not in FULL_ERRNOS:
                raise HsextractError(f"cannot keep a cache in {self.cache_dir}: {e}") from None
            self._read_through(e)
        self._real_root = os.path.realpath(self.root)

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
        if v is None or length <= 0 or offset >= v[1] or not _plain_key(key):
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
        except IsADirectoryError:  # not a block the cache wrote: the cache's damage, not the output's
            log.warning("cache block %s is a directory, not a block: removed, fetched again", path)
            self._remove(path)
            return None
        data, digest = memoryview(raw)[:-_DIGEST], raw[-_DIGEST:]
        want = min(BLOCK_BYTES, size - block * BLOCK_BYTES)
        if len(raw) != want + _DIGEST or _digest(data) != digest:
            log.warning(
                "cache block %s is damaged (%d bytes, checksum mismatch): dropped, fetched again",
                path,
                len(raw),
            )
            if self._remove(path):
                self._count(-len(raw))
            return None
        return data

    def _inside(self, path: Path) -> bool:
        """``path``'s folder is inside this output's cache folder, no link leading out of it."""
        parent = os.path.realpath(path.parent)
        return parent == self._real_root or parent.startswith(self._real_root + os.sep)

    def _remove(self, path: Path) -> bool:
        """Remove what is at a block's place (a file, a link, a folder) inside this output's cache folder."""
        if not self._inside(path):
            log.warning("cache block %s leads out of %s through a link: left alone", path, self.root)
            return False
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            return False  # another process dropped it first
        except OSError as e:
            log.warning("cache block %s cannot be removed (%s)", path, e)
            return False
        return True

    def _count(self, n: int) -> None:
        try:
            self._usage.add(n)
        except OSError as e:
            self._read_through(e)

    def _read_through(self, e: OSError) -> None:
        if not self._full:
            log.warning("cache %s cannot store blocks (%s): read through from now on", self.cache_dir, e)
        self._full = True

    def _store(self, key: str, tag: str, block: int, data) -> bool:
        n = len(data) + _DIGEST
        path = self._path(key, tag, block)
        if not self._inside(path):
            self._read_through(OSError(f"{path.parent} leads out of {self.root} through a link"))
            return False
        try:
            reserved = self._usage.reserve(n, self.max_bytes, self._evict)
        except OSError as e:  # the count cannot be written: the disk is full
            self._read_through(e)
            return False
        if not reserved:
            self._full = True
            log.info(
                "cache %s is full (%d bytes): further blocks of %s are read through",
                self.cache_dir,
                self.max_bytes,
                self.sink.url,
            )
            return False
        try:
            atomic_write(path, lambda f: (f.write(data), f.write(_digest(data))), durable=False)
        except OSError as e:
            self._read_through(e)
            self._count(-n)
            return False
        return True

    def _evict(self, need: int) -> int:
        """Remove other outputs' blocks (least recently used first), then stale versions of this output's files,
        until ``need`` bytes are free; returns the bytes removed. Only the cache's own folders are candidates
        (``owned_outputs``); rmtree removes links inside them, never what they point to. Called with the usage
        lock held."""
        freed = 0
        others = [p for p in owned_outputs(self.cache_dir) if p.name != self.root.name]
        for path in sorted(others, key=lambda p: p.lstat().st_mtime):
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
    """The cache's size in bytes, in ``.hsextract-cache-usage`` with its checksum, updated under the lock
    ``.hsextract-cache-lock`` by every process sharing it. It can only overstate (two processes storing the same
    block both count it): the limit holds."""

    def __init__(self, cache_dir: Path):
        self.cache_dir, self.path, self.lock = cache_dir, cache_dir / USAGE, cache_dir / LOCK

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
            text = self.path.read_text()
        except FileNotFoundError:
            return self._walk()
        except (OSError, UnicodeDecodeError):
            text = ""
        count, _, check = text.strip().partition(" ")
        if count.isdigit() and check == _usage_check(int(count)):
            return int(count)
        log.warning(
            "cache usage file %s holds %r, not a count this cache wrote: counted again from its blocks",
            self.path,
            text[:80],
        )
        return self._walk()

    def _walk(self) -> int:
        return sum(_tree_bytes(p) for p in owned_outputs(self.cache_dir))

    def _write(self, used: int) -> None:
        used = max(0, used)
        atomic_write(self.path, f"{used} {_usage_check(used)}", durable=False)

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


def _usage_check(count: int) -> str:
    return xxhash.xxh3_64(f"hsextract-cache-usage:{count}".encode()).hexdigest()


def _plain_key(key: str) -> bool:
    """A key that names a place inside the output's cache folder (no ``..``, not absolute)."""
    parts = key.split("/")
    return bool(key) and not key.startswith("/") and all(p not in ("", ".", "..") for p in parts)


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
