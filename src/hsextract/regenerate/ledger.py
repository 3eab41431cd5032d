"""The output of ``hsextract regenerate``: a directory (or S3 prefix) that ``hsextract run --data`` reads as it is.

A chunk is stored whole after its sealed record (its key, size, sha256 and ids), and counts as done only when the
record proves itself and the chunk's bytes match it; ``done`` repairs or sets aside the rest and says so.
``regenerate.json`` holds the settings, sealed, written first. No bookkeeping file ends as a data file does, so
``run`` never reads one as rows. docs/DATA.md and docs/RELIABILITY.md describe the files and their proofs.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import time
import zlib
from dataclasses import dataclass, field

from hsextract.errors import HsextractError
from hsextract.prepare.rows import (
    REGENERATE_BOOKKEEPING,
    REGENERATE_FORMATS,
    REGENERATE_SETTINGS,
    REGENERATED_CHUNK,
    read_regenerate_record,
)
from hsextract.prepare.sources import changed_files
from hsextract.storage import open_sink
from hsextract.storage.base import Sink
from hsextract.validation import seal, seal_problem

FORMAT = REGENERATE_FORMATS[0]


CHUNK = REGENERATED_CHUNK


RECORD = re.compile(r"^chunk-(\d{6,})\.record$")


EXTENSIONS = {"zstd": "zst", "gzip": "gz"}


def chunk_key(index: int, compression: str) -> str:
    return f"chunk-{index:06d}.jsonl.{EXTENSIONS[compression]}"


def record_key(index: int) -> str:
    return f"chunk-{index:06d}.record"


def compress(lines: bytes, compression: str) -> bytes:
    """The chunk's bytes: one zstd frame with its checksum (a changed byte is caught on read), or gzip."""
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(lines)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=6, mtime=0) as f:
        f.write(lines)
    return buffer.getvalue()


def decompress(data: bytes, key: str) -> bytes:
    """The chunk's lines; ``ValueError`` for a frame cut short, damaged, or followed by other bytes."""
    if key.endswith(".zst"):
        import zstandard

        try:
            frame = zstandard.ZstdDecompressor().decompressobj()
            lines = frame.decompress(data)
        except zstandard.ZstdError as e:
            raise ValueError(f"zstd: {e}") from None
        if not frame.eof:
            raise ValueError("its zstd frame is cut short")
        if frame.unused_data:
            raise ValueError(f"{len(frame.unused_data)} bytes follow its zstd frame")
        return lines
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"gzip: {e}") from None


def chunk_ids(data: bytes, key: str) -> list[str]:
    """The ids of a chunk's rows, read whole; ``ValueError`` when it is not sound on its own."""
    ids = []
    for n, line in enumerate(decompress(data, key).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            raise ValueError(f"line {n} is not JSON") from None
        if not (isinstance(row, dict) and isinstance(row.get("id"), str)):
            raise ValueError(f"line {n} is not a row with an id")
        ids.append(row["id"])
    return ids


def chunk_record(key: str, data: bytes, written: list[str], dropped: list[str]) -> dict:
    """What proves a chunk: its key, size and sha256, and the ids it holds (written) or stands for (dropped),
    sealed. One dict per chunk: a field may be added."""
    return seal(
        {
            "chunk": key,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "written": written,
            "dropped": dropped,
        }
    )


def record_problem(record, key: str, data: bytes) -> str | None:
    """Why ``record`` does not prove chunk ``key`` with bytes ``data``, or None."""
    if (problem := seal_problem(record)) is not None:
        return f"its record does not prove itself ({problem})"
    if record.get("chunk") != key:
        return f"its record names {record.get('chunk')!r:.60}"
    if not all(
        isinstance(record.get(k), list) and all(isinstance(i, str) for i in record[k])
        for k in ("written", "dropped")
    ):
        return "its record's written and dropped are not lists of ids"
    if record.get("size") != len(data) or record.get("sha256") != hashlib.sha256(data).hexdigest():
        return f"its {len(data)} bytes are not the {record.get('size')!r:.20} bytes its record names (sha256)"
    return None


@dataclass
class Done:
    """What complete chunks hold: the ids written and those dropped (``--drop-truncated``), the next index, and
    what was found wrong and done about it (``notes``, to say)."""

    written: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    chunks: int = 0
    next_index: int = 0
    notes: list[str] = field(default_factory=list)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.written or sample_id in self.dropped


class Ledger:
    """The output directory: its settings record, its chunks and their records, new chunks written whole."""

    def __init__(self, output: str, s3_endpoint_url: str | None = None, *, sink: Sink | None = None):
        self.output = output
        self.sink = sink or open_sink(output, s3_endpoint_url)

    def check_settings(self, settings: dict, sources: list[dict], *, restart: bool) -> dict | None:
        """Compare ``settings`` with the output's record; the record (None for a new output). Other settings are
        refused naming each difference, unless ``restart``, which empties the output first."""
        if restart:
            self.clear()
            return None
        record = self._record()
        if record is None:
            if any(CHUNK.match(k) or REGENERATE_BOOKKEEPING.match(k) for k in self.sink.list_keys("chunk-")):
                raise HsextractError(
                    f"{self.output} holds chunk files but no {REGENERATE_SETTINGS}: it is no regenerate output "
                    "this command can resume; give an empty directory, or --restart to delete its chunks"
                )
            return None
        differences = describe_differences(record["settings"], settings)
        if record["settings"].get("data") != settings.get("data"):
            changed = changed_files(record["sources"], sources)
            differences.append("the data" + (f" ({'; '.join(changed)})" if changed else ""))
        if differences:
            raise HsextractError(
                f"{self.output} was regenerated with other settings: {'; '.join(differences)}. Rerun with the "
                "settings it was written with to resume, or pass --restart to delete its chunks and start over"
            )
        return record

    def _record(self) -> dict | None:
        where = f"{self.output}/{REGENERATE_SETTINGS}"
        try:
            data = self.sink.get_bytes(REGENERATE_SETTINGS)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise HsextractError(
                f"{where} is a directory: remove it, or --restart starts the output over"
            ) from None
        record = read_regenerate_record(data, where)
        if record["format"] != FORMAT:
            if any(RECORD.match(k) for k in self.sink.list_keys("chunk-")):
                raise HsextractError(
                    f"{where} is damaged (format {record['format']} beside chunk records of {FORMAT}): restore "
                    "it, or rerun with --restart to start the output over"
                )
            record = {**record, "format": FORMAT}  # an older output, resumed: its record sealed from now on
            self.sink.put_bytes(REGENERATE_SETTINGS, json.dumps(seal(record), indent=1).encode())
        return record

    def write_settings(self, settings: dict, sources: list[dict], served: dict) -> None:
        """The record, before any request: settings compared on rerun, the rest shown by ``run``'s data report."""
        record = {
            "format": FORMAT,
            "settings": settings,
            "served": served,
            "sources": sources,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self.sink.put_bytes(REGENERATE_SETTINGS, json.dumps(seal(record), indent=1).encode())

    def clear(self) -> None:
        for key in self.sink.list_keys("chunk-"):
            if CHUNK.match(key) or REGENERATE_BOOKKEEPING.match(key):
                self.sink.delete(key)
        self.sink.delete(REGENERATE_SETTINGS)

    def done(self) -> Done:
        """The rows of the chunks that prove themselves. A chunk whose record is missing, damaged or contradicted
        is read whole: one sound on its own (its zstd or gzip checksums, a row with an id on every line) gets its
        record again, any other is set aside (``.rejected``) and its rows are requested again; a record without its
        chunk is removed. Each is said in ``Done.notes``."""
        self.sink.discard_partials("chunk-")  # a killed write's temporary file: never a complete chunk
        keys = sorted(self.sink.list_keys("chunk-"))
        chunks = {int(m.group(1)): k for k in keys if (m := CHUNK.match(k))}
        records = {int(m.group(1)): k for k in keys if (m := RECORD.match(k))}
        done = Done()
        for index in sorted(set(chunks) | set(records)):
            done.next_index = max(done.next_index, index + 1)
            key = chunks.get(index)
            if key is None:
                self.sink.delete(records[index])
                done.notes.append(
                    f"{record_key(index)}: its chunk is missing (a write cut short, or deleted): record removed, "
                    "its rows are requested again"
                )
                continue
            data = self.sink.get_bytes(key)
            listed, problem = self._proved(records.get(index), key, data)
            if listed is None:
                try:
                    ids = chunk_ids(data, key)
                except ValueError as e:
                    self.sink.put_bytes(key + ".rejected", data)
                    self.sink.delete(key)
                    if index in records:
                        self.sink.delete(records[index])
                    done.notes.append(
                        f"{key}: {problem}, and the chunk is not sound on its own ({e}): set aside as "
                        f"{key}.rejected, its rows are requested again"
                    )
                    continue
                listed = {"written": ids, "dropped": []}
                self.sink.put_bytes(record_key(index), json.dumps(chunk_record(key, data, ids, [])).encode())
                done.notes.append(
                    f"{key}: {problem}; the chunk is sound on its own: its record is written again from its "
                    f"{len(ids)} rows"
                )
            done.chunks += 1
            done.written.update(listed["written"])
            done.dropped.update(listed["dropped"])
        for key in keys:
            if key.endswith(".rows.json"):  # an older hsextract's row list: each chunk has its record now
                self.sink.delete(key)
        return done

    def _proved(self, key: str | None, chunk: str, data: bytes) -> tuple[dict | None, str]:
        """The chunk's record when it proves the chunk, else None and what is wrong."""
        if key is None:
            return None, "it has no record"
        try:
            record = json.loads(self.sink.get_bytes(key))
        except (OSError, ValueError, RecursionError):
            return None, "its record is not JSON"
        problem = record_problem(record, chunk, data)
        return (record, "") if problem is None else (None, problem)

    def write_chunk(self, index: int, rows: list[dict], dropped: list[str], compression: str) -> str:
        """Chunk ``index`` stored whole, its record first; returns its key."""
        lines = b"".join(json.dumps(row, ensure_ascii=False).encode() + b"\n" for row in rows)
        data = compress(lines, compression)
        key = chunk_key(index, compression)
        record = chunk_record(key, data, [row["id"] for row in rows], dropped)
        self.sink.put_bytes(record_key(index), json.dumps(record).encode())
        self.sink.put_bytes(key, data)
        return key


def describe_differences(before: dict, now: dict) -> list[str]:
    """``name old -> new`` for each setting that differs (the data is compared by the caller)."""
    lines = []
    flat_before = {**{k: v for k, v in before.items() if k != "request"}, **(before.get("request") or {})}
    flat_now = {**{k: v for k, v in now.items() if k != "request"}, **(now.get("request") or {})}
    for name in sorted(set(flat_before) | set(flat_now)):
        if name == "data":
            continue
        a, b = flat_before.get(name), flat_now.get(name)
        if a != b:
            flag = "--" + name.replace("_", "-")
            lines.append(f"{flag} {_shown(a)} -> {_shown(b)}")
    return lines


def _shown(value) -> str:
    if value is None:
        return "(not given)"
    return json.dumps(value) if isinstance(value, (dict, list, str)) else str(value)
