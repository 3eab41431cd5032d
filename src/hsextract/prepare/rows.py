"""Reading dataset rows: JSONL, JSON, Parquet or a datasets.save_to_disk directory, and their fingerprints."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hsextract.errors import HsextractError
from hsextract.prepare.chat import UnreadableRow

ACCEPTED_FORMATS = ".jsonl, .json or .parquet file, or a directory written by datasets.Dataset.save_to_disk"


def _data_format(path: Path) -> str:
    if not path.exists():
        raise HsextractError(f"data path {path} does not exist; give a {ACCEPTED_FORMATS}")
    if path.is_dir():
        return "dataset_dir"
    if not path.is_file():
        raise HsextractError(
            f"data path {path} is not a regular file (a FIFO, a device?): hsextract reads the data more than "
            "once (its fingerprint, then its rows); write it to a file first"
        )
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet"):
        return suffix[1:]
    raise HsextractError(
        f"cannot read {path}: unknown format {suffix or '(no extension)'!r}; give a {ACCEPTED_FORMATS}"
    )


def _open_rows(path: Path) -> tuple[Iterator[Any], int | None]:
    """The rows of ``path`` in order, and their count when known without a pass over the data."""
    kind = _data_format(path)
    if kind == "jsonl":
        return _jsonl_rows(path), None
    if kind == "json":
        rows = _json_rows(path)
        return iter(rows), len(rows)
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:
            raise HsextractError(f"cannot read {path} as parquet: {e}") from e
        batches = parquet.iter_batches(batch_size=1024)
        return (row for batch in batches for row in batch.to_pylist()), parquet.metadata.num_rows
    dataset = _load_dataset_dir(path)
    return _dataset_rows(dataset), len(dataset)


def _jsonl_rows(path: Path) -> Iterator[Any]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) hold no row
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield UnreadableRow(f"line {line_no} is not valid JSON ({e})")
            except RecursionError:
                yield UnreadableRow(f"line {line_no} nests too deeply to be a row")


def _json_rows(path: Path) -> list:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise HsextractError(
            f"cannot parse {path} as JSON ({type(e).__name__}: {e}); a .jsonl file holds one row per line"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise HsextractError(
            f'{path} must hold a JSON list of rows or {{"data": [...]}}, got {type(data).__name__}'
        )
    return data


def _load_dataset_dir(path: Path):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise HsextractError(
            f"cannot load directory {path} with datasets.load_from_disk ({e}); give a {ACCEPTED_FORMATS}"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            return loaded["train"]
        if len(splits) == 1:
            return loaded[splits[0]]
        raise HsextractError(
            f"{path} holds splits {splits} and none is 'train'; save the one to use on its own"
        )
    return loaded


def _dataset_rows(dataset) -> Iterator[dict]:
    for batch in dataset.with_format("arrow").iter(batch_size=1024):
        yield from batch.to_pylist()


def read_rows(path: str | Path) -> Iterator[Any]:
    """The rows of a data file in order; a JSONL line that is not JSON comes as an ``UnreadableRow``."""
    return _open_rows(Path(path))[0]


def data_fingerprint(path: str | Path) -> str:
    """blake2b of the data bytes; for a directory, of every file's relative path and bytes, in sorted order.

    Memoized per (path, size, mtime) of each file: preparing a run asks for it twice (cache key and plan), and a
    large dataset takes seconds to hash."""
    path = Path(path)
    _data_format(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _data_fingerprint(path.resolve(), stamp)


@functools.lru_cache(maxsize=8)
def _data_fingerprint(path: Path, stamp: tuple) -> str:
    digest = hashlib.blake2b(digest_size=32)
    files = [Path(f) for f, _, _ in stamp]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        digest.update(str(file.stat().st_size).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
