"""The output of ``hsextract regenerate``: a directory (or S3 prefix) that ``hsextract run --data`` reads as it is.

A chunk is the unit of durability: stored whole under its final name after its row list, so a chunk that exists is
complete and its list says what it holds; the rows listed beside complete chunks are never requested again.
``regenerate.json`` holds the settings, written first. docs/DATA.md describes the files.
"""

from __future__ import annotations

import gzip
import io
import json
import time
from dataclasses import dataclass, field

from hsextract.errors import HsextractError
from hsextract.prepare.rows import REGENERATE_SETTINGS, REGENERATED_CHUNK
from hsextract.prepare.sources import changed_files
from hsextract.storage import open_sink
from hsextract.storage.base import Sink

FORMAT = "hsextract-regenerate/1"


CHUNK = REGENERATED_CHUNK


EXTENSIONS = {"zstd": "zst", "gzip": "gz"}


def chunk_key(index: int, compression: str) -> str:
    return f"chunk-{index:06d}.jsonl.{EXTENSIONS[compression]}"


def rows_key(index: int) -> str:
    return f"chunk-{index:06d}.rows.json"


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
    if key.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return gzip.decompress(data)


@dataclass
class Done:
    """What complete chunks hold: the ids written and those dropped (``--drop-truncated``), and the next index."""

    written: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    chunks: int = 0
    next_index: int = 0

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.written or sample_id in self.dropped


class Ledger:
    """The output directory: its settings record, its complete chunks, and new chunks written whole."""

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
            if any(CHUNK.match(k) for k in self.sink.list_keys("chunk-")):
                raise HsextractError(
                    f"{self.output} holds chunk files but no {REGENERATE_SETTINGS}: it is no regenerate output "
                    "this command can resume; give an empty directory, or --restart to delete its chunks"
                )
            return None
        differences = describe_differences(record.get("settings") or {}, settings)
        if record.get("settings", {}).get("data") != settings.get("data"):
            changed = changed_files(record.get("sources") or [], sources)
            differences.append("the data" + (f" ({'; '.join(changed)})" if changed else ""))
        if differences:
            raise HsextractError(
                f"{self.output} was regenerated with other settings: {'; '.join(differences)}. Rerun with the "
                "settings it was written with to resume, or pass --restart to delete its chunks and start over"
            )
        return record

    def _record(self) -> dict | None:
        try:
            record = json.loads(self.sink.get_bytes(REGENERATE_SETTINGS))
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise HsextractError(
                f"{self.output}/{REGENERATE_SETTINGS} is damaged ({e}): --restart starts the output over"
            ) from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise HsextractError(
                f"{self.output}/{REGENERATE_SETTINGS} is not a record of this version ({FORMAT}): --restart "
                "starts the output over"
            )
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
        self.sink.put_bytes(REGENERATE_SETTINGS, json.dumps(record, indent=1).encode())

    def clear(self) -> None:
        for key in self.sink.list_keys("chunk-"):
            if CHUNK.match(key) or key.endswith(".rows.json"):
                self.sink.delete(key)
        self.sink.delete(REGENERATE_SETTINGS)

    def done(self) -> Done:
        """The rows of complete chunks, from their row lists (a chunk missing its list is read itself)."""
        self.sink.discard_partials("chunk-")  # a killed write's temporary file: never a complete chunk
        keys = set(self.sink.list_keys("chunk-"))
        done = Done()
        for key in sorted(keys):
            match = CHUNK.match(key)
            if match is None:
                continue
            index = int(match.group(1))
            done.chunks += 1
            done.next_index = max(done.next_index, index + 1)
            listed = self._row_list(rows_key(index)) if rows_key(index) in keys else None
            if listed is None:
                lines = decompress(self.sink.get_bytes(key), key).splitlines()
                listed = {
                    "written": [json.loads(line)["id"] for line in lines if line.strip()],
                    "dropped": [],
                }
            done.written.update(listed["written"])
            done.dropped.update(listed["dropped"])
        return done

    def _row_list(self, key: str) -> dict | None:
        try:
            listed = json.loads(self.sink.get_bytes(key))
        except (FileNotFoundError, ValueError):
            return None
        if not isinstance(listed, dict) or not all(
            isinstance(listed.get(k), list) for k in ("written", "dropped")
        ):
            return None
        return listed

    def write_chunk(self, index: int, rows: list[dict], dropped: list[str], compression: str) -> str:
        """Chunk ``index`` stored whole, its row list first; returns its key."""
        lines = b"".join(json.dumps(row, ensure_ascii=False).encode() + b"\n" for row in rows)
        data = compress(lines, compression)
        listed = {"written": [row["id"] for row in rows], "dropped": dropped}
        self.sink.put_bytes(rows_key(index), json.dumps(listed).encode())
        key = chunk_key(index, compression)
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
