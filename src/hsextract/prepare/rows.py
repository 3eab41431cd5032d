"""Reading the rows of one data file or dataset directory, and their fingerprints.

JSONL (plain, .gz, .zst), JSON, Parquet, or a ``save_to_disk`` directory; every reader yields rows one at a time,
so a large file is never held as Python objects, and a JSONL line can travel unparsed to the tokenizer process
that parses it. Which files make a run's data, and how they are mixed, is sources.py's job.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from hsextract.errors import HsextractError
from hsextract.prepare.chat import UnreadableRow
from hsextract.storage.fileio import write_json
from hsextract.validation import unseal

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet")


REGENERATE_SETTINGS = "regenerate.json"

"""The settings record of an ``hsextract regenerate`` output; the rows of a directory that holds one (or any of its
bookkeeping files) are its chunk files only (``REGENERATED_CHUNK``), never its records."""


REGENERATED_CHUNK = re.compile(r"^chunk-(\d{6,})\.jsonl\.(zst|gz)$")


REGENERATE_BOOKKEEPING = re.compile(r"^chunk-\d{6,}\.(record|rows\.json|jsonl\.(zst|gz)\.rejected)$")

"""A chunk's record, an older hsextract's row list, or a chunk set aside as damaged: never rows."""


REGENERATE_FORMATS = ("hsextract-regenerate/2", "hsextract-regenerate/1")

"""The settings record's formats, newest first; /1 (unsealed, row lists beside the chunks) is still read."""


def is_regenerate_output(names) -> bool:
    """Whether a directory whose files are ``names`` (relative to it) was written by ``hsextract regenerate``."""
    return any(n == REGENERATE_SETTINGS or REGENERATE_BOOKKEEPING.match(n) for n in names)


def read_regenerate_record(data: bytes, where: str) -> dict:
    """The settings record of a regenerate output, proving itself (sealed, from /2 on) and typed; one that does not
    is one message naming the file and what is wrong."""

    def damaged(problem: str) -> HsextractError:
        return HsextractError(
            f"{where} is damaged ({problem}): restore it, or rerun hsextract regenerate with --restart to start "
            "that output over"
        )

    try:
        record = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise damaged(f"not JSON: {e}") from None
    if not isinstance(record, dict):
        raise damaged(f"not a JSON object but {type(record).__name__}")
    if record.get("format") not in REGENERATE_FORMATS:
        raise damaged(f"format {record.get('format')!r:.40} is none of {', '.join(REGENERATE_FORMATS)}")
    record = unseal(record, damaged, required=record["format"] != REGENERATE_FORMATS[-1])
    settings, served, sources = record.get("settings"), record.get("served"), record.get("sources")
    problems = []
    if not isinstance(settings, dict):
        problems.append("settings: not an object")
    else:
        problems += [
            f"settings.{k}: not a string" for k in ("served_model", "turns") if not _str(settings.get(k))
        ]
        if not isinstance(settings.get("request"), dict):
            problems.append("settings.request: not an object")
    if not isinstance(served, dict):
        problems.append("served: not an object")
    if not isinstance(sources, list) or not all(
        isinstance(s, dict) and _str(s.get("name"), True) and _str(s.get("source"), True) for s in sources
    ):
        problems.append("sources: not a list of {name, source} objects")
    if problems:
        raise damaged("; ".join(problems))
    return record


def _str(value, none_too: bool = False) -> bool:
    return isinstance(value, str) or (none_too and value is None)


def regenerated_summary(data: bytes, where: str) -> dict:
    """What a data report shows of a regenerate output's record: its settings, the served model, its inputs."""
    record = read_regenerate_record(data, where)
    inputs = [{"name": s.get("name"), "source": s.get("source")} for s in record["sources"]]
    return {"settings": record["settings"], "served": record["served"], "inputs": inputs}


def check_regenerated_rendering(sources: list[dict], template_kwargs: dict) -> None:
    """Refuse replies of ``hsextract regenerate`` rendered here with other template arguments than the servers
    rendered their prompts with (``regenerate.json``'s ``chat_template_kwargs``): the states would be of a
    conversation the target never saw, e.g. ``enable_thinking`` true on replies made with it false."""
    regenerated = {}
    for s in sources:
        settings = ((s.get("identity") or {}).get("regenerated") or {}).get("settings")
        if isinstance(settings, dict):
            request = settings.get("request") if isinstance(settings.get("request"), dict) else {}
            regenerated[f"{s.get('name')} ({s.get('source')})"] = request.get("chat_template_kwargs") or {}
    made = {json.dumps(kwargs, sort_keys=True) for kwargs in regenerated.values()}
    if len(made) > 1:
        each = "; ".join(
            f"{name}: {json.dumps(kwargs, sort_keys=True)}" for name, kwargs in regenerated.items()
        )
        raise HsextractError(
            f"the regenerated sources were made with different chat_template_kwargs ({each}): one rendering "
            "cannot match them all; extract them in separate runs, each with its own --chat-template-kwargs"
        )
    given = json.dumps(template_kwargs or {}, sort_keys=True)
    if made and given not in made:
        name, kwargs = next(iter(regenerated.items()))
        wanted = json.dumps(kwargs, sort_keys=True)
        fix = f"pass --chat-template-kwargs '{wanted}'" if kwargs else "leave --chat-template-kwargs out"
        raise HsextractError(
            f"{name} holds replies regenerated with chat_template_kwargs {wanted} (its {REGENERATE_SETTINGS}), "
            f"but this run renders with {given}: the states would be of prompts the replies did not answer; "
            f"{fix}, as the regeneration did"
        )


ACCEPTED_FORMATS = (
    ".jsonl (or .jsonl.gz / .jsonl.zst), .json or .parquet file, or a directory written by "
    "datasets.Dataset.save_to_disk"
)


def file_format(path: Path) -> str | None:
    """``jsonl``, ``jsonl.gz``, ``jsonl.zst``, ``json`` or ``parquet`` from the name; None for other files."""
    name = path.name.lower()
    for suffix in sorted(DATA_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix[1:]
    return None


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
    kind = file_format(path)
    if kind is None:
        raise HsextractError(
            f"cannot read {path}: unknown format {path.suffix or '(no extension)'!r}; give a {ACCEPTED_FORMATS}"
        )
    return kind


class JsonLine(NamedTuple):
    """A JSONL line as read (non-blank), not parsed yet; ``parse_line`` makes it the row ``read_rows`` would give."""

    line_no: int
    text: bytes


def _open_rows(path: Path, parse: bool = True) -> tuple[Iterator[Any], int | None]:
    """The rows of ``path`` in order, and their count when known without a pass over the data; with ``parse=False``
    a JSONL file's rows are ``JsonLine``s."""
    kind = _data_format(path)
    if kind.startswith("jsonl"):
        lines = (JsonLine(line_no, text) for line_no, text in _jsonl_lines(path))
        return (map(parse_line, lines) if parse else lines), None
    if kind == "json":
        rows = _json_rows(path)
        return iter(rows), len(rows)
    if kind == "parquet":
        parquet = _parquet_file(path)
        batches = parquet.iter_batches(batch_size=1024)
        return (row for batch in batches for row in batch.to_pylist()), parquet.metadata.num_rows
    dataset = _load_dataset_dir(path)
    return _dataset_rows(dataset), len(dataset)


def count_rows(path: Path) -> int:
    """Rows in ``path``: from the metadata where the format has it, else one pass over the lines."""
    rows, total = _open_rows(path)
    if total is not None:
        return total
    return sum(1 for _ in _jsonl_lines(path))


def _parquet_file(path: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise HsextractError(f"cannot read {path} as parquet ({e}): is the file complete?") from e


def _open_binary(path: Path):
    """The file's bytes, decompressed as they are read for ``.gz`` and ``.zst``."""
    name = path.name.lower()
    if name.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(open(path, "rb")))
    return open(path, "rb")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstd frame of ``raw`` in turn. A stream that ends inside a frame raises
    ``EOFError`` (zstandard's ``stream_reader`` ends quietly there: a cut file would read as a shorter one). A frame
    written without a checksum cannot show a changed byte; the data report records each file's hash instead."""

    CHUNK = 1 << 16  # compressed bytes per step: bounds the bytes one step decompresses

    def __init__(self, raw):
        import zstandard

        self.raw, self._dctx, self._frame = raw, zstandard.ZstdDecompressor(), None
        self._left, self._out = b"", memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            data = self._left or self.raw.read(self.CHUNK)
            self._left = b""
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the zstd stream ends inside a frame: the file is cut short")
                return 0
            if self._frame is None or self._frame.eof:
                self._frame = self._dctx.decompressobj()
            self._out = memoryview(self._frame.decompress(data))
            if self._frame.eof:
                self._left = self._frame.unused_data  # the next frame's first bytes
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of the non-blank lines; a damaged compressed stream is an error naming the file."""
    try:
        with _open_binary(path) as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():  # blank lines (a trailing newline, say) hold no row
                    yield line_no, line
    except (OSError, EOFError) as e:
        raise HsextractError(
            f"cannot read {path}: {e}. The compressed file is damaged or cut short; fetch it again"
        ) from e
    except Exception as e:  # zstandard.ZstdError is not an OSError
        if type(e).__module__.startswith("zstandard"):
            raise HsextractError(f"cannot read {path}: {e}. The .zst file is damaged; fetch it again") from e
        raise


def parse_line(line: JsonLine) -> Any:
    """The row a JSONL line holds, or an ``UnreadableRow`` saying why it holds none."""
    try:
        return json.loads(line.text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return UnreadableRow(f"line {line.line_no} is not valid JSON ({e})")
    except RecursionError:
        return UnreadableRow(f"line {line.line_no} nests too deeply to be a row")


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


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _load_dataset_dir(path: Path):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise HsextractError(
            f"cannot load directory {path} with datasets.load_from_disk ({e}); give a {ACCEPTED_FORMATS}"
        ) from e
    return pick_split(loaded, None, str(path))


def pick_split(loaded, split: str | None, where: str):
    """The split to read of a Dataset or DatasetDict: ``split`` if given, else ``train`` or the only one."""
    import datasets

    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    splits = list(loaded)
    if split is not None:
        if split not in loaded:
            raise HsextractError(f"{where} has no split {split!r}; it has {splits}: give split= one of those")
        return loaded[split]
    if "train" in loaded:
        return loaded["train"]
    if len(splits) == 1:
        return loaded[splits[0]]
    raise HsextractError(
        f"{where} holds splits {splits} and none is 'train'; choose one with split=NAME (or save it on its own)"
    )


def dataset_rows(dataset) -> Iterator[dict]:
    """The rows of a ``datasets.Dataset`` in order, read 1024 at a time."""
    for batch in dataset.with_format("arrow").iter(batch_size=1024):
        yield from batch.to_pylist()


_dataset_rows = dataset_rows


def read_rows(path: str | Path, *, parse: bool = True) -> Iterator[Any]:
    """The rows of a data file in order; a JSONL line that is not JSON comes as an ``UnreadableRow``, and with
    ``parse=False`` every JSONL line as a ``JsonLine``."""
    return _open_rows(Path(path), parse)[0]


def first_row(path: Path) -> Any:
    """The first row of a data file (None when it has none), read without a pass over the rest."""
    if file_format(path) == "parquet":
        for batch in _parquet_file(path).iter_batches(batch_size=1):
            rows = batch.to_pylist()
            if rows:
                return rows[0]
        return None
    rows = read_rows(path)
    try:
        return next(iter(rows), None)
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()


def column_names(path: Path) -> list[str] | None:
    """The columns of a Parquet file from its schema; None for formats without one."""
    if file_format(path) == "parquet":
        return list(_parquet_file(path).schema_arrow.names)
    return None


def data_fingerprint(path: str | Path) -> str:
    """blake2b of the data bytes; for a directory, of every file's relative path and bytes, in sorted order.

    Memoized per (path, size, mtime, ctime) of each file: preparing a run asks for it twice (cache key and plan), and a
    large dataset takes seconds to hash."""
    path = Path(path)
    _data_format(path)
    return tree_fingerprint(path)


def tree_fingerprint(path: Path, memo_dir: Path | None = None) -> str:
    """``data_fingerprint`` of any file or directory, whatever its format. With ``memo_dir`` (a run dir's cache)
    the hash is also kept there under its files' stamp, so a relaunch does not read the data again."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    # ctime too: a file rewritten with its size and mtime set back (touch -d) still misses the memo; the inode and
    # device: another file moved into its place.
    stats = [f.stat() for f in files]
    stamp = tuple(
        (str(f), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        for f, st in zip(files, stats, strict=True)
    )
    if memo_dir is None:
        return _data_fingerprint(path.resolve(), stamp)
    key = hashlib.sha256(repr((str(path.resolve()), stamp)).encode()).hexdigest()[:24]
    memo = Path(memo_dir) / f"data-{key}.json"
    try:
        digest = json.loads(memo.read_text())["blake2b"]
        if isinstance(digest, str) and len(digest) == 64:
            return digest
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = _data_fingerprint(path.resolve(), stamp)
    memo.parent.mkdir(parents=True, exist_ok=True)
    write_json(memo, {"path": str(path), "blake2b": digest}, durable=False)
    return digest


@functools.lru_cache(maxsize=64)
def _data_fingerprint(path: Path, stamp: tuple) -> str:
    digest = hashlib.blake2b(digest_size=32)
    files = [Path(f) for f, *_ in stamp]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        digest.update(str(file.stat().st_size).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
