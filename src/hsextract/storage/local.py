"""A local directory as an output."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hsextract.errors import HsextractError, disk_full
from hsextract.storage.base import (
    PROBE_PREFIX,
    Sink,
    StoredObject,
    changed_file,
    check_key,
    fill,
    read_range_via_into,
    read_with_crc32,
)
from hsextract.storage.fileio import TMP_MARK, atomic_write, fsync_dir, stale_tmp, tmp_path

_CACHED_PART = 256 << 10

"""Bytes read at a time when the caller looks at each part as it arrives: they are still in the CPU's cache."""


class LocalSink(Sink):
    """Objects as files under a directory (local disk or a shared file system)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key

    def put_file(self, local_path: Path, key: str, expected_crc32: int | None = None) -> StoredObject:
        dest = self._path(key)
        expected = os.stat(local_path).st_size

        def copy(out: BinaryIO) -> tuple[int, int]:
            size, crc = read_with_crc32(Path(local_path), copy_to=out)
            if (
                expected_crc32 is not None and crc != expected_crc32
            ):  # raised before the rename: nothing stored
                raise changed_file(Path(local_path), crc, expected_crc32)
            return size, crc

        size, crc = self._write_atomically(dest, copy)
        if size != expected:
            raise HsextractError(f"copying {local_path} to {dest} wrote {size} bytes, expected {expected}")
        return StoredObject(key, size, crc)

    def put_bytes(self, key: str, data: bytes) -> None:
        def write(out: BinaryIO) -> tuple[int, int]:
            out.write(data)
            return len(data), zlib.crc32(data)

        self._write_atomically(self._path(key), write)

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_path(dest)
        try:
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp, dest)  # fails if dest exists: a complete file appears under the name, or nothing
            except FileExistsError:
                return False
            fsync_dir(dest.parent)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def stored(self, key: str) -> StoredObject | None:
        try:
            return StoredObject(key, self._path(key).stat().st_size, None)
        except FileNotFoundError:
            return None

    def checksum(self, key: str) -> StoredObject | None:
        try:
            size, crc = read_with_crc32(self._path(key))
        except FileNotFoundError:
            return None
        return StoredObject(key, size, crc)

    def _write_atomically(self, dest: Path, write: Callable[[BinaryIO], tuple[int, int]]) -> tuple[int, int]:
        """Write through ``write(file) -> (size, crc32)``; renamed into place only after fsync."""
        try:
            return atomic_write(dest, write)
        except OSError as e:
            raise disk_full(e) or HsextractError(f"could not write {dest}: {e}") from e

    def get_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    read_range = read_range_via_into

    def read_range_into(self, key: str, offset: int, buffer, on_part=None) -> int:
        fd = os.open(self._path(key), os.O_RDONLY)
        try:
            piece = _CACHED_PART if on_part is not None else None
            return fill(lambda part, done: os.preadv(fd, [part], offset + done), buffer, piece, on_part)
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def local_file(self, key: str) -> str | None:
        return str(self.root / key)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def missing_place(self) -> str | None:
        if self.root.is_dir():
            return None
        if self.root.exists():
            return f"{self.root} is not a directory: give the output directory a run wrote"
        return f"the directory {self.root} does not exist: check the path (an output is the --output a run wrote)"

    def list_keys(self, prefix: str = "") -> list[str]:
        # Walk only the directory the prefix names, not the whole tree.
        start = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        keys = []
        for dirpath, _dirnames, filenames in os.walk(start):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if TMP_MARK in name or name.startswith(PROBE_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def remove_stale_temps(self, prefix: str = "") -> list[str]:
        start = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        removed = []
        for dirpath, _dirnames, filenames in os.walk(start):
            for name in filenames:
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if TMP_MARK in name and key.startswith(prefix) and stale_tmp(path):
                    try:
                        path.unlink()
                    except OSError:  # gone already, or not ours to delete (a read-only output)
                        continue
                    removed.append(key)
        return sorted(removed)

    def discard_partials(self, prefix: str) -> int:
        start = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        removed = 0
        for dirpath, _dirnames, filenames in os.walk(start):
            for name in filenames:
                path = Path(dirpath) / name
                if TMP_MARK in name and path.relative_to(self.root).as_posix().startswith(prefix):
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed
