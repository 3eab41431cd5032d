"""``sample_index.safetensors``: every sample of a finished output in one file, so a trainer indexes the output
with one read instead of two per batch file.

Written at finalize, before the manifest, which records its xxh3. Flat numpy arrays aligned to their item size, so
a reader maps it and a node's DataLoader workers share its pages (docs/FORMAT.md lists them). No torch here.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from hsextract.container import arrays, buffer_head, header_bytes, header_json, kind_of, layout, map_file
from hsextract.errors import CorruptOutputError
from hsextract.output.manifest import SAMPLE_INDEX  # named there: the manifest records it

INDEX_FORMAT = "hsextract-sample-index"

INDEX_FORMAT_VERSION = 1


@dataclass
class SampleTable:
    """The arrays of the file (numpy views into its bytes when read back): made from the batch files
    (``from_files``), written (``encode``, ``write``) and read back (``read``, ``decode``) here."""

    keys: list[str]
    file: np.ndarray
    row: np.ndarray
    start: np.ndarray
    length: np.ndarray
    file_first: np.ndarray
    ids: np.ndarray
    id_offsets: np.ndarray
    token_bytes: int
    skips: dict[str, np.ndarray] = field(default_factory=dict)
    skip_reasons: dict[str, list[str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.file)

    def sample_id(self, i: int) -> str:
        return bytes(self.ids[self.id_offsets[i] : self.id_offsets[i + 1]]).decode()

    def sample_ids_at(self, positions: np.ndarray) -> list[str]:
        """The ids of the samples at ``positions`` (one decode of the ids, not one per sample)."""
        text = bytes(self.ids).decode()
        starts, stops = self.id_offsets[positions].tolist(), self.id_offsets[positions + 1].tolist()
        if len(text) != len(self.ids):  # not ASCII: offsets count bytes
            raw = bytes(self.ids)
            return [raw[a:b].decode() for a, b in zip(starts, stops, strict=True)]
        return [text[a:b] for a, b in zip(starts, stops, strict=True)]

    def file_sample_ids(self, f: int) -> list[str]:
        """The ids of every sample of file ``f``, in row order (what its header lists)."""
        a, b = int(self.file_first[f]), int(self.file_first[f + 1])
        blob = bytes(self.ids[self.id_offsets[a] : self.id_offsets[b]]).decode()
        cuts = (self.id_offsets[a : b + 1] - self.id_offsets[a]).tolist()
        if blob.isascii():
            return [blob[x:y] for x, y in zip(cuts[:-1], cuts[1:], strict=True)]
        raw = blob.encode()
        return [raw[x:y].decode() for x, y in zip(cuts[:-1], cuts[1:], strict=True)]

    @classmethod
    def from_files(
        cls,
        keys: list[str],
        files: list[tuple[list[str], list[int]]],
        token_bytes: int,
        skips: dict[str, tuple[list[str], list[int]]] | None = None,
    ) -> SampleTable:
        """The table of files given as (sample ids, cu_seqlens), in manifest order; ``skips``: per schema, its
        reasons and one code per sample (0: served)."""
        counts = np.array([len(ids) for ids, _ in files], dtype=np.int64)
        file_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        n = int(file_first[-1])
        cu = [np.asarray(c, dtype=np.int64) for _, c in files]
        starts = np.concatenate([c[:-1] for c in cu]) if cu else np.zeros(0, np.int64)
        lengths = np.concatenate([np.diff(c) for c in cu]) if cu else np.zeros(0, np.int64)
        encoded = [sid.encode() for ids, _ in files for sid in ids]
        id_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=id_offsets[1:])
        return cls(
            keys=list(keys),
            file=np.repeat(np.arange(len(files), dtype=np.int32), counts),
            row=(np.arange(n, dtype=np.int64) - np.repeat(file_first[:-1], counts)).astype(np.int32),
            start=starts.astype(np.int32),
            length=lengths.astype(np.int32),
            file_first=file_first,
            ids=np.frombuffer(b"".join(encoded), dtype=np.uint8),
            id_offsets=id_offsets,
            token_bytes=token_bytes,
            skips={name: np.asarray(codes, dtype=np.uint8) for name, (_, codes) in (skips or {}).items()},
            skip_reasons={name: list(reasons) for name, (reasons, _) in (skips or {}).items()},
        )

    def encode(self) -> bytes:
        """The file's bytes: the same table gives the same bytes (two nodes finishing at once write one object)."""
        tensors = _arrays(self)
        metadata = {
            "format": INDEX_FORMAT,
            "format_version": str(INDEX_FORMAT_VERSION),
            "keys": json.dumps(self.keys),
            "token_bytes": str(self.token_bytes),
            "skip_reasons": json.dumps(self.skip_reasons, sort_keys=True),
        }
        head = header_bytes(
            layout((name, kind_of(a.dtype), a.shape) for name, a in tensors.items()), metadata
        )
        return b"".join([head, *(np.ascontiguousarray(a).tobytes() for a in tensors.values())])

    def write(self, sink) -> dict:
        """Put the file in the output; returns the manifest's ``sample_index`` entry (its key, size and xxh3)."""
        data = self.encode()
        sink.put_bytes(SAMPLE_INDEX, data)
        return {"key": SAMPLE_INDEX, "size": len(data), "xxh3": checksum(data)}

    @classmethod
    def decode(cls, buffer, damaged) -> SampleTable:
        """The table in ``buffer`` (bytes or a memory map; the arrays are views into it). ``damaged(problem)`` makes
        the error raised for a file that is not a well-formed index."""
        head = buffer_head(buffer, damaged)
        header = header_json(head, damaged)
        try:
            meta = header.pop("__metadata__")
            if meta.get("format") != INDEX_FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            if int(meta["format_version"]) > INDEX_FORMAT_VERSION:
                raise ValueError(f"format version {meta['format_version']}: upgrade hsextract")
            found = arrays(buffer, header, len(head), lambda why: ValueError(why))
            keys = json.loads(meta["keys"])
            table = cls(
                keys=keys,
                file=found["file"],
                row=found["row"],
                start=found["start"],
                length=found["length"],
                file_first=found["file_first"],
                ids=found["ids"],
                id_offsets=found["id_offsets"],
                token_bytes=int(meta["token_bytes"]),
                skips={name[len("skip.") :]: a for name, a in found.items() if name.startswith("skip.")},
                skip_reasons=json.loads(meta["skip_reasons"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise damaged(f"is not a readable sample index ({e})") from None
        n = len(table.file)
        consistent = (
            len(table.file_first) == len(keys) + 1
            and int(table.file_first[-1]) == n
            and len(table.row) == len(table.start) == len(table.length) == n
            and len(table.id_offsets) == n + 1
            and int(table.id_offsets[-1]) == len(table.ids)
            and all(len(codes) == n for codes in table.skips.values())
        )
        if not consistent:
            raise damaged(f"has arrays of inconsistent lengths for {n} samples in {len(keys)} files")
        return table

    @classmethod
    def read(cls, sink, entry: dict, verify: bool) -> tuple[SampleTable, str, bool]:
        """The output's index, checked against ``entry`` (the manifest's), and the local file it is mapped from;
        True if that file is a temporary copy (an S3 output's: one read)."""

        def damaged(problem: str) -> CorruptOutputError:
            return CorruptOutputError(sink.url, entry["key"], problem)

        if (path := sink.local_file(entry["key"])) is not None:
            copied = False
            try:
                data = map_file(path)
            except FileNotFoundError:
                raise damaged("does not exist (the manifest lists it)") from None
        else:
            try:
                raw = sink.get_bytes(entry["key"])
            except FileNotFoundError:
                raise damaged("does not exist (the manifest lists it)") from None
            fd, path = tempfile.mkstemp(
                prefix="hsextract-sample-index-", suffix=".safetensors", dir=_copy_dir()
            )
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            del raw
            data, copied = map_file(path), True
        try:
            if len(data) != entry["size"]:
                raise damaged(f"has {len(data)} bytes; the manifest recorded {entry['size']}")
            if verify and checksum(data) != entry["xxh3"]:
                raise damaged(
                    f"does not match its checksum (xxh3 {checksum(data)}, recorded {entry['xxh3']})"
                )
            return cls.decode(data, damaged), path, copied
        except CorruptOutputError:
            if copied:
                Path(path).unlink(missing_ok=True)
            raise

    @staticmethod
    def remove_copy(path: str, pid: int) -> None:
        """Remove a temporary copy, in the process that made it only: a forked DataLoader worker inherits the
        finalizer that calls this and runs it at its exit, while the copy is still in use."""
        if os.getpid() == pid:
            Path(path).unlink(missing_ok=True)


def _arrays(table: SampleTable) -> dict[str, np.ndarray]:
    """The file's tensors in file order: widest first, so that each starts aligned to its item size with no gap
    between them (safetensors allows none)."""
    arrays = {
        "file_first": table.file_first,
        "id_offsets": table.id_offsets,
        "file": table.file,
        "length": table.length,
        "row": table.row,
        "start": table.start,
        **{f"skip.{name}": codes for name, codes in sorted(table.skips.items())},
        "ids": table.ids,
    }
    return dict(sorted(arrays.items(), key=lambda kv: -kv[1].dtype.itemsize))


def checksum(data) -> str:
    """What the manifest records of the file: xxh3_64 of its bytes (16 hex)."""
    return xxhash.xxh3_64(data).hexdigest()


def _copy_dir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def check_sample_index(sink, manifest: dict) -> int:
    """``hsextract verify``'s check of the index: its size and checksum, its structure, and that it lists the
    manifest's batch files with their sample ids and token counts. Returns its size; raises
    ``CorruptOutputError`` naming it."""
    entry = manifest["sample_index"]
    table, path, copied = SampleTable.read(sink, entry, verify=True)
    try:

        def differs(problem: str) -> CorruptOutputError:
            return CorruptOutputError(sink.url, entry["key"], f"{problem}; the output is damaged")

        batches = manifest["batches"]
        if table.keys != [b["key"] for b in batches]:
            raise differs("lists other batch files than the manifest")
        tokens = np.add.reduceat(table.length.astype(np.int64), table.file_first[:-1]) if len(table) else []
        for f, b in enumerate(batches):
            a, z = int(table.file_first[f]), int(table.file_first[f + 1])
            if table.file_sample_ids(f) != b["sample_ids"]:
                raise differs(f"lists other samples for {b['key']} than the manifest")
            if z > a and "num_tokens" in b and int(tokens[f]) != b["num_tokens"]:
                raise differs(f"counts {int(tokens[f])} tokens in {b['key']}, the manifest {b['num_tokens']}")
        return entry["size"]
    finally:
        del table
        if copied:
            SampleTable.remove_copy(path, os.getpid())
