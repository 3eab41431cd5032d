"""Where output lives: a local directory or an S3 prefix, behind one small interface (``Sink``).

The contract: when ``put_file`` returns, the object is complete and verified under its final key (a rerun may
upload a batch twice, never half of one), and given the writer's CRC32 it stores nothing if the bytes sent differ.
No torch here: the light uploader process runs it.
"""

from __future__ import annotations

import abc
import base64
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from hsextract.errors import StagedFileChanged

log = logging.getLogger(__name__)

PROBE_PREFIX = ".hsextract-probe-"
PROBE_CONTENT = b"hsextract preflight probe\n"


MiB = 1 << 20


DEFAULT_RETRY_DEADLINE_S = 30 * 60.0


FIRST_BACKOFF_S = 0.5


MAX_BACKOFF_S = 30.0


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


def changed_file(path: Path, crc: int, expected: int) -> StagedFileChanged:
    return StagedFileChanged(
        f"{path} changed after it was written: the bytes read to upload it have CRC32 {crc:08x}, its writer wrote "
        f"{expected:08x}; not uploaded"
    )


def crc32_base64(crc: int) -> str:
    """The encoding S3 uses for CRC32 checksums: the 4 big-endian bytes, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class Sink(abc.ABC):
    """Where output objects go. Keys are relative, '/'-separated paths; ``url`` names the sink's root."""

    url: str

    @abc.abstractmethod
    def put_file(self, local_path: Path, key: str, expected_crc32: int | None = None) -> StoredObject:
        """Store a complete local file under ``key``; when this returns the object is durable and verified.

        With ``expected_crc32`` (the CRC32 its writer computed), the bytes stored must have it: else
        ``StagedFileChanged`` is raised and nothing is left under ``key``. The local file is left in place: the
        caller deletes it once it has recorded the upload.
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

    def checksum(self, key: str) -> StoredObject | None:
        """Like ``stored``, with the CRC32 computed from the object's bytes where the store keeps none (reads the
        whole object); None if there is none."""
        return self.stored(key)

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The whole object; ``FileNotFoundError`` if there is none."""

    @abc.abstractmethod
    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the end of the object)."""

    def read_range_into(
        self, key: str, offset: int, buffer, on_part: Callable[[int, int], None] | None = None
    ) -> int:
        """Bytes from ``offset`` into ``buffer`` (any writable contiguous buffer: a ``memoryview`` of a tensor's
        memory, say), as many as it holds or fewer at the end of the object; returns how many. ``on_part(a, b)``
        says that bytes ``a:b`` of the buffer have just arrived (a few hundred KB at a time, so that the reader
        checksums them while they are in the CPU's cache); a retried read starts again at ``a = 0``. The reader
        reads states straight into the memory of the tensors it returns; this default copies what ``read_range``
        gives."""
        view = memoryview(buffer).cast("B")
        data = self.read_range(key, offset, len(view))
        view[: len(data)] = data
        if on_part is not None:
            on_part(0, len(data))
        return len(data)

    def get_file(self, key: str, local_path: Path) -> None:
        """Download the object to ``local_path`` (a temporary name, then renamed: a file under its final name is
        complete); ``FileNotFoundError`` if there is none."""
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        part = local_path.with_name(f".{local_path.name}.part")
        buffer = bytearray(_READ_CHUNK)
        try:
            with open(part, "wb") as f:
                while n := self.read_range_into(key, f.tell(), buffer):
                    f.write(memoryview(buffer)[:n])
            os.replace(part, local_path)
        finally:
            part.unlink(missing_ok=True)

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size of the object in bytes; ``FileNotFoundError`` if there is none."""

    def local_file(self, key: str) -> str | None:
        """The object's path on this machine when the store is a local directory (it can be mapped in place),
        else None."""
        return None

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""

    @abc.abstractmethod
    def list_keys(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix``, relative to the sink root, sorted; incomplete uploads are not listed."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; removing a missing one is not an error."""

    def missing_place(self) -> str | None:
        """Why the place this sink names does not exist (no directory, no bucket, nothing under the prefix), in
        words for the user; None when it exists. Readers ask it before saying a run has not finished."""
        return None

    def remove_stale_temps(self, prefix: str = "") -> list[str]:
        """Remove the temporary files under ``prefix`` that writes which ended (a killed process) left, and return
        their keys. Safe while other processes write: a file is removed only once its writer has gone
        (``fileio.stale_tmp``). An object store leaves none (an object appears whole or not at all)."""
        return []


def removed_temps_note(keys: list[str]) -> str:
    """The line that says which temporary files ``remove_stale_temps`` removed, or "" for none."""
    if not keys:
        return ""
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return (
        f"removed {len(keys)} temporary file{'s' if len(keys) != 1 else ''} that interrupted writes left in the "
        f"output ({', '.join(keys[:3])}{more}); they were never part of it"
    )

    @abc.abstractmethod
    def discard_partials(self, prefix: str) -> int:
        """Remove uploads under ``prefix`` that a killed uploader left unfinished; returns how many.

        Only safe while no uploader writes under ``prefix``: a worker calls it on resume, before starting its
        uploader, for its own shard's prefix."""


def read_range_via_into(sink: Sink, key: str, offset: int, length: int) -> bytearray:
    """``read_range`` of a sink whose own primitive is ``read_range_into``: the bytes in a buffer of their own
    (writable, so the reader makes tensors over it without another copy)."""
    buf = bytearray(max(0, length))
    got = sink.read_range_into(key, offset, buf)
    return buf if got == len(buf) else buf[:got]


def fill(
    read_into: Callable[[memoryview, int], int],
    buffer,
    piece: int | None = None,
    on_part: Callable[[int, int], None] | None = None,
) -> int:
    """``buffer`` filled by ``read_into(part, done)`` (which reads into ``part`` what follows the ``done`` bytes
    already there, and returns how many, 0 at the end) in parts of at most ``piece``, each told to ``on_part(a, b)``;
    how many bytes it got."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        n = read_into(view[done : done + piece] if piece else view[done:], done)
        if not n:
            break
        if on_part is not None:
            on_part(done, done + n)
        done += n
    return done


# -- object keys ----------------------------------------------------------------------------------------------------
def check_key(key: str) -> None:
    """Every sink's rule for an object key: a relative path, without ``..`` or backslashes."""
    if not key or key.startswith("/") or "\\" in key or ".." in key.split("/"):
        raise ValueError(
            f"invalid object key {key!r}: expected a relative path such as 'shard-00000/batch-000000'"
        )
