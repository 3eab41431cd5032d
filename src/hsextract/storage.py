"""Where output lives: a local directory or an S3 prefix, behind one small interface.

A ``Sink`` stores objects under keys such as ``shard-00000/batch-000123.safetensors``. ``LocalSink(root)`` maps a
key to ``root/key``; ``S3Sink(bucket, prefix)`` to ``s3://bucket/prefix/key``. ``open_sink`` picks one from the
output string (``s3://...`` or a path) and ``preflight`` checks, before any model loads, that the output can be
written, so that a typo in a bucket name costs seconds, not a model load.

Durability contract: when ``put_file`` returns, the object is complete and verified under its final key, and it
returns a ``StoredObject`` (key, size, CRC32) that the uploader records in its marker. Writing the same key again
is allowed and replaces the object, so a rerun after a crash may upload a batch twice but never leaves half of one.

- Local: the file is copied to ``root/key.tmp-<pid>-<tid>`` while its CRC32 is computed, fsynced, renamed over the
  final name and the directory fsynced; a file under its final name is complete. Leftover ``.tmp-`` files from a
  crash are invisible to ``list_keys``.
- S3: see s3.py (multipart upload with a full-object CRC32, verified with head_object, retried).

This module must not import torch: it runs in the light uploader process.
"""

from __future__ import annotations

import abc
import base64
import logging
import os
import re
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from hsextract.errors import HsextractError
from hsextract.rundir import TMP_MARK, atomic_write, fsync_dir, tmp_path

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_RETRY_DEADLINE_S = 30 * 60.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
PROBE_PREFIX = ".hsextract-probe-"
PROBE_CONTENT = b"hsextract preflight probe\n"
_READ_CHUNK = 8 * MiB

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoredObject:
    """An object in the output: its key, size in bytes and CRC32 (as zlib computes it; None where unknown)."""

    key: str
    size: int
    crc32: int | None


def read_with_crc32(path: Path, copy_to: BinaryIO | None = None) -> tuple[int, int]:
    """Size and CRC32 of a file's content in one pass, writing the content to ``copy_to`` on the way if given."""
    crc = 0
    size = 0
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
            if copy_to is not None:
                copy_to.write(view[:n])
            size += n
    return size, crc


def crc32_base64(crc: int) -> str:
    """The encoding S3 uses for CRC32 checksums: the 4 big-endian bytes, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def check_key(key: str) -> None:
    if not key or key.startswith("/") or "\\" in key or ".." in key.split("/"):
        raise ValueError(
            f"invalid object key {key!r}: expected a relative path such as 'shard-00000/batch-000000'"
        )


class Sink(abc.ABC):
    """Where output objects go. Keys are relative, '/'-separated paths; ``url`` names the sink's root."""

    url: str

    @abc.abstractmethod
    def put_file(self, local_path: Path, key: str) -> StoredObject:
        """Store a complete local file under ``key``; when this returns the object is durable and verified.

        The local file is left in place: the caller deletes it once it has recorded the upload.
        """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any object there, as durably as ``put_file``."""

    @abc.abstractmethod
    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` only if no object is there, atomically (of two racing callers exactly one
        wins); returns whether this call created it."""

    @abc.abstractmethod
    def stored(self, key: str) -> StoredObject | None:
        """Size and, where the store keeps one cheaply, the full-object CRC32 (else ``crc32`` is None) of the
        object under ``key``; None if there is none."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The whole object; ``FileNotFoundError`` if there is none."""

    @abc.abstractmethod
    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the end of the object)."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size of the object in bytes; ``FileNotFoundError`` if there is none."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""

    @abc.abstractmethod
    def list_keys(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix``, relative to the sink root, sorted; incomplete uploads are not listed."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; removing a missing one is not an error."""

    @abc.abstractmethod
    def discard_partials(self, prefix: str) -> int:
        """Remove uploads under ``prefix`` that a killed uploader left unfinished; returns how many.

        Only safe while no uploader writes under ``prefix``: a worker calls it on resume, before starting its
        uploader, for its own shard's prefix."""


class LocalSink(Sink):
    """Objects as files under a directory (local disk or a shared file system)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key

    def put_file(self, local_path: Path, key: str) -> StoredObject:
        dest = self._path(key)
        expected = os.stat(local_path).st_size
        size, crc = self._write_atomically(dest, lambda out: read_with_crc32(Path(local_path), copy_to=out))
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

    def _write_atomically(self, dest: Path, write: Callable[[BinaryIO], tuple[int, int]]) -> tuple[int, int]:
        """Write through ``write(file) -> (size, crc32)``; renamed into place only after fsync."""
        try:
            return atomic_write(dest, write)
        except OSError as e:
            raise HsextractError(f"could not write {dest}: {e}") from e

    def get_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        with open(self._path(key), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

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


def _parse_output(output: str) -> tuple[str, str] | Path:
    """``(bucket, prefix)`` for an ``s3://`` URL, else the local directory."""
    scheme, sep, rest = output.partition("://")
    if not sep:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", output):
            raise HsextractError(
                f"the output '{output}' looks like a URL with a missing slash: write "
                f"{output.split(':', 1)[0]}://BUCKET/prefix (or ./{output} for a local directory)"
            )
        return Path(output)
    if scheme.lower() == "s3":
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise HsextractError(
                f"the output URL '{output}' names no bucket: write s3://BUCKET/optional/prefix"
            )
        return bucket, prefix
    if scheme.lower() == "file":
        return Path(rest)
    raise HsextractError(
        f"the output '{output}' has an unsupported scheme '{scheme}://': use s3://... or a local path"
    )


def open_sink(
    output: str, endpoint_url: str | None = None, *, retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S
) -> Sink:
    """The sink for an output string: ``s3://bucket/optional/prefix`` gives an S3Sink, a path a LocalSink."""
    where = _parse_output(output)
    if isinstance(where, Path):
        return LocalSink(where)
    from .s3 import S3Sink

    return S3Sink(*where, endpoint_url, retry_deadline_s=retry_deadline_s)


def preflight(output: str, endpoint_url: str | None = None) -> None:
    """Check within seconds that ``output`` can be written: write, read back and delete a probe object.

    Raises ``HsextractError`` saying what is wrong: a missing bucket, refused or missing credentials, denied
    access, an unreachable endpoint, or an unwritable directory.
    """
    where = _parse_output(output)
    sink: Sink
    if isinstance(where, Path):
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HsextractError(f"cannot create the output directory {where}: {e}") from e
        sink = LocalSink(where)
    else:
        from .s3 import S3Sink

        # Short timeouts and a short retry budget: a preflight must fail in seconds, not after 30 minutes.
        sink = S3Sink(
            *where,
            endpoint_url,
            retry_deadline_s=5.0,
            connect_timeout_s=3.0,
            read_timeout_s=5.0,
            botocore_max_attempts=1,
        )
    probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    sink.put_bytes(probe, PROBE_CONTENT)
    try:
        if sink.get_bytes(probe) != PROBE_CONTENT:
            raise HsextractError(
                f"a probe object written to {sink.url} read back different: check the endpoint"
            )
    finally:
        sink.delete(probe)
