"""Data sources: where a run's rows come from, how several are mixed, and what identifies each.

Sources are files, directories, ``hf:`` ids or ``s3://`` locations with options (docs/DATA.md lists them); rows are
streamed. A row's id is its ``id`` field, else its position before any selection, so a changed limit renames
nothing. Each source's identity and options go into the plan's fingerprint, so a changed source is refused on
resume; everything here runs before any weight loads and fails naming the source.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from hsextract.errors import HsextractError
from hsextract.prepare import rows as rowio
from hsextract.prepare.hub_source import is_hub_folder, load_hub, load_hub_folder, load_saved
from hsextract.prepare.source_spec import (
    SourceSpec,
    parse_sources,
)

ROW_KIND_FIELDS = ("input_ids", "messages", "conversations", "text")


"""The fields that decide a row's kind, in the order chat.py tries them."""


def map_columns(row: Any, columns: tuple[tuple[str, str], ...]) -> Any:
    """The row with each mapped column read as its field; a mapped row-kind field decides the kind alone."""
    if not columns or not isinstance(row, dict):
        return row
    targets = {t for t, _ in columns}
    drop = set(ROW_KIND_FIELDS) if targets & set(ROW_KIND_FIELDS) else set()
    sources = {c for _, c in columns}
    out = {k: v for k, v in row.items() if k not in drop and k not in sources}
    for target, column in columns:
        out[target] = row.get(column)
    return out


def row_kind(row: Any) -> str | None:
    if not isinstance(row, dict):
        return None
    return next((k for k in ROW_KIND_FIELDS if row.get(k) is not None), None)


@dataclass(frozen=True)
class Source:
    """A resolved source: what to read, how many rows it has (when known) and what identifies it."""

    spec: SourceSpec
    name: str
    label: str
    """How messages name it: ``'name' (location)`` in a mix, else the location."""
    kind: str
    """``files``, ``saved_dataset``, ``hub_folder``, ``hf`` or ``s3``."""
    files: tuple[Path, ...] = ()
    dataset: Any = None
    identity: dict = field(default_factory=dict)

    def digest(self) -> str:
        """The identity's hash for the plan, without file paths and mtimes: content decides (a copied or touched
        file is the same source), as it does for a single file."""
        identity = {k: v for k, v in self.identity.items() if k != "files"}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]

    def available(self) -> int:
        """Rows in the source before any selection (one pass over the JSONL files)."""
        if self.dataset is not None:
            return len(self.dataset)
        return sum(rowio.count_rows(f) for f in self.files)

    def selected(self, seed: int) -> list[int] | None:
        """Sorted row positions kept by ``fraction`` / ``sample``; None when every row (up to ``limit``) is."""
        spec = self.spec
        if spec.fraction is None and spec.sample is None:
            return None
        import numpy as np

        total = self.available()
        k = spec.sample if spec.sample is not None else max(1, round(total * spec.fraction))
        if k > total:
            raise HsextractError(
                f"data source {self.label}: sample={k} asks for more rows than its {total}; lower it or drop it"
            )
        key = hashlib.sha256(f"hsextract-sample:{seed}:{self.name}:{spec.location}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
        return np.sort(rng.choice(total, size=k, replace=False)).tolist()

    def rows(self, seed: int, *, parse: bool = True) -> Iterator[tuple[int, Any]]:
        """``(position in the source, row)`` of the selected rows, columns mapped, in source order; with
        ``parse=False`` a JSONL line comes as a ``JsonLine`` that ``finish_row`` completes."""
        chosen = self.selected(seed)
        if self.dataset is not None:
            data = self.dataset
            if chosen is not None:
                positions: Any = chosen
                data = data.select(chosen)
            else:
                n = len(data) if self.spec.limit is None else min(self.spec.limit, len(data))
                positions, data = range(n), data.select(range(n)) if n < len(data) else data
            pairs: Iterator[tuple[int, Any]] = zip(positions, rowio.dataset_rows(data), strict=True)
        else:
            pairs = enumerate(row for f in self.files for row in rowio.read_rows(f, parse=parse))
            if chosen is not None:
                pairs = _keep_positions(pairs, chosen)
            elif self.spec.limit is not None:
                pairs = islice(pairs, self.spec.limit)
        for position, row in pairs:
            yield position, row if isinstance(row, rowio.JsonLine) else map_columns(row, self.spec.columns)


def finish_row(row: Any, columns: tuple[tuple[str, str], ...]) -> Any:
    """The row ``Source.rows`` gives with ``parse=True``, from what it gave with ``parse=False``."""
    return map_columns(rowio.parse_line(row), columns) if isinstance(row, rowio.JsonLine) else row


def _keep_positions(pairs: Iterator[tuple[int, Any]], chosen: list[int]) -> Iterator[tuple[int, Any]]:
    wanted = iter(chosen)
    target = next(wanted, None)
    for position, row in pairs:
        if target is None:
            return
        if position == target:
            yield position, row
            target = next(wanted, None)


@dataclass(frozen=True)
class Mix:
    """The run's sources in order; its rows are theirs, one source after the other."""

    sources: tuple[Source, ...]
    seed: int = 0
    limit: int | None = None
    """At most this many rows in all, the first of the mix (``--max-samples``); None: every selected row."""

    @property
    def prefixed(self) -> bool:
        """Sample ids carry ``name/`` when there are several sources or a source was given a name."""
        return len(self.sources) > 1 or any(s.spec.name for s in self.sources)

    def rows(self, *, parse: bool = True) -> Iterator[tuple[int, int, Any]]:
        """``(source index, position in that source, row)`` of every selected row (``Source.rows`` for ``parse``),
        the first ``limit`` of them."""
        rows = (
            (i, position, row)
            for i, source in enumerate(self.sources)
            for position, row in source.rows(self.seed, parse=parse)
        )
        yield from rows if self.limit is None else islice(rows, self.limit)

    def within_limit(self, counts: list[int]) -> list[int]:
        """Each source's selected row count, cut to what the first ``limit`` rows of the mix take of it."""
        if self.limit is None:
            return list(counts)
        left, out = self.limit, []
        for n in counts:
            out.append(min(n, left))
            left -= out[-1]
        return out

    def sample_id(self, source_index: int, row_id: str) -> str:
        return f"{self.sources[source_index].name}/{row_id}" if self.prefixed else row_id

    def fingerprint(self) -> dict:
        """What of the data shapes the plan. One plain source keeps the single content hash of older plans."""
        limited = {} if self.limit is None else {"max_samples": self.limit}
        if not self.prefixed and not self.sources[0].spec.options():
            return {"data": self.sources[0].identity.get("hash") or self.sources[0].digest(), **limited}
        return {
            **limited,
            # Keyed by name (which the sample ids carry), whether given or derived.
            "sources": {s.name: {**_unnamed(s.spec.options()), "identity": s.digest()} for s in self.sources},
            **({"seed": self.seed} if any(s.spec.fraction or s.spec.sample for s in self.sources) else {}),
        }

    def describe(self) -> list[dict]:
        """Per source: name, location, kind, options and identity, for the data report."""
        return [
            {
                "name": s.name,
                "source": s.spec.location,
                "kind": s.kind,
                "options": s.spec.options(),
                "identity": s.identity,
            }
            for s in self.sources
        ]


def _unnamed(options: dict) -> dict:
    return {k: v for k, v in options.items() if k != "name"}


def resolve_sources(
    data, *, seed: int = 0, cache_dir: Path | None = None, s3_endpoint_url: str | None = None
) -> Mix:
    """Find every source's files or dataset and check them (existence, columns, one row kind per source)."""
    specs = parse_sources(data)
    names = _source_names(specs)
    sources = []
    labelled = len(specs) > 1 or any(s.name for s in specs)
    for spec, name in zip(specs, names, strict=True):
        label = f"'{name}' ({spec.location})" if labelled else spec.location
        source = _resolve(spec, name, label, cache_dir, s3_endpoint_url)
        _check_columns(source)
        sources.append(source)
    return Mix(tuple(sources), seed)


def _source_names(specs: tuple[SourceSpec, ...]) -> list[str]:
    given = [s.name for s in specs if s.name]
    if len(given) != len(set(given)):
        raise HsextractError(f"two data sources share a name ({', '.join(given)}): give each its own name=")
    names: list[str] = []
    taken = set(given)
    for spec in specs:
        if spec.name:
            names.append(spec.name)
            continue
        base = _default_name(spec.location)
        name, n = base, 2
        while name in taken:
            name, n = f"{base}-{n}", n + 1
        taken.add(name)
        names.append(name)
    return names


def _default_name(location: str) -> str:
    text = location.rstrip("/")
    if text.startswith("hf:"):
        text = text[3:]
    parts = [p for p in re.split(r"[/:]", text) if p and not any(c in p for c in "*?[")]
    base = parts[-1] if parts else "data"
    for suffix in sorted(rowio.DATA_SUFFIXES, key=len, reverse=True):
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
            break
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.") or "data"
    return base if base[0].isalnum() else f"data{base}"


def _resolve(spec: SourceSpec, name: str, label: str, cache_dir: Path | None, endpoint: str | None) -> Source:
    location = spec.location
    options = {"config": spec.config, "split": spec.split, "revision": spec.revision}
    if location.startswith("hf:"):
        dataset, identity = load_hub(location[3:], **options, label=label, cache=None)
        return Source(spec, name, label, "hf", dataset=dataset, identity=identity)
    if location.lower().startswith("s3://"):
        from hsextract.prepare.s3_source import fetch_s3_files

        files, identity = fetch_s3_files(location, label, cache_dir, endpoint)
        return _files_source(spec, name, label, "s3", files, identity)
    path = Path(location)
    is_dataset = path.is_dir() and (rowio.is_saved_dataset(path) or is_hub_folder(path))
    if (spec.split or spec.config or spec.revision) and not is_dataset:
        raise HsextractError(
            f"data source {label}: split, config and revision apply to hf: ids and dataset directories only"
        )
    if any(c in location for c in "*?[") and not path.exists():
        matches = sorted(Path(p) for p in glob.glob(location, recursive=True))
        files = [p for p in matches if p.is_file() and rowio.file_format(p)]
        if not files:
            raise HsextractError(
                f"data source {label}: the glob matches no data file ({len(matches)} match(es) in all); "
                f"data files end in {', '.join(rowio.DATA_SUFFIXES)}"
            )
        return _files_source(spec, name, label, "files", files, memo_dir=cache_dir)
    if not path.exists():
        raise HsextractError(
            f"data source {label} does not exist: give a {rowio.ACCEPTED_FORMATS}, a glob, a dataset directory, "
            "hf:ORG/NAME or s3://BUCKET/PREFIX"
        )
    if path.is_dir() and rowio.is_saved_dataset(path):
        dataset = load_saved(path, spec.split, label)
        identity = {"kind": "saved_dataset", "hash": rowio.tree_fingerprint(path), "split": spec.split}
        return Source(spec, name, label, "saved_dataset", dataset=dataset, identity=identity)
    if path.is_dir() and is_hub_folder(path):
        dataset, identity = load_hub_folder(path, **options, label=label, cache_dir=cache_dir)
        return Source(spec, name, label, "hub_folder", dataset=dataset, identity=identity)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and rowio.file_format(p))
        regenerated = _regenerated(path)
        if rowio.is_regenerate_output(p.name for p in path.iterdir()):  # its chunks, never its records
            files = [p for p in files if p.parent == path and rowio.REGENERATED_CHUNK.match(p.name)]
        if not files:
            raise HsextractError(
                f"data source {label}: the directory holds no data file (none ends in "
                f"{', '.join(rowio.DATA_SUFFIXES)}) and is no saved or Hub-layout dataset"
            )
        source = _files_source(spec, name, label, "files", files, memo_dir=cache_dir)
        if regenerated is not None:
            source.identity["regenerated"] = regenerated
        return source
    try:
        rowio._data_format(path)
    except HsextractError as e:
        raise HsextractError(f"data source {label}: {e}") from None
    return _files_source(spec, name, label, "files", [path], memo_dir=cache_dir)


def _regenerated(path: Path) -> dict | None:
    """The summary of a regenerate output's record, when ``path`` is one."""
    record = path / rowio.REGENERATE_SETTINGS
    if not record.is_file():
        return None
    return rowio.regenerated_summary(record.read_bytes(), f"{path}/{rowio.REGENERATE_SETTINGS}")


def _files_source(
    spec: SourceSpec,
    name: str,
    label: str,
    kind: str,
    files: list[Path],
    identity: dict | None = None,
    memo_dir: Path | None = None,
) -> Source:
    """``memo_dir``: where each file's content hash is kept under its stamp (``rows.tree_fingerprint``)."""
    kinds: dict[str, list[Path]] = {}
    for f in files:
        try:
            row = rowio.first_row(f)
        except HsextractError as e:
            raise HsextractError(f"data source {label}: {e}") from None
        found = row_kind(map_columns(row, spec.columns))
        if found is not None:
            kinds.setdefault(found, []).append(f)
    if len(kinds) > 1:
        detail = "; ".join(f"{k} in {', '.join(p.name for p in ps[:3])}" for k, ps in kinds.items())
        raise HsextractError(
            f"data source {label} mixes row kinds across its files ({detail}): give each kind as its own source"
        )
    if identity is None:
        hashes = [rowio.tree_fingerprint(f, memo_dir) for f in files]
        identity = {
            "kind": "files",
            "hash": hashes[0]
            if len(files) == 1
            else hashlib.blake2b("".join(hashes).encode(), digest_size=32).hexdigest(),
            # Each file's content hash: a .zst without frame checksums, or any plain file, cannot show a changed
            # byte itself; on resume a changed file is named by it (``changed_files``).
            "files": [
                {"path": str(f), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns, "hash": h}
                for f, h in zip(files[:100], hashes, strict=False)
            ],
            "file_count": len(files),
        }
    return Source(spec, name, label, kind, files=tuple(files), identity=identity)


def _check_columns(source: Source) -> None:
    """Every mapped column exists, read from the dataset's schema or the first row of each file."""
    if not source.spec.columns:
        return
    if source.dataset is not None:
        schemas = [("", list(source.dataset.column_names))]
    else:
        schemas = []
        for f in source.files:
            names = rowio.column_names(f)
            if names is None:
                row = rowio.first_row(f)
                names = list(row) if isinstance(row, dict) else []
            schemas.append((f.name, names))
    for where, names in schemas:
        for target, column in source.spec.columns:
            if column not in names:
                raise HsextractError(
                    f"data source {source.label}: column {column!r} (given for {target}) is not in its rows"
                    + (f" (file {where})" if where else "")
                    + f"; they have {', '.join(sorted(names)) or 'no columns'}: fix columns="
                )


def changed_files(before: list[dict], now: list[dict]) -> list[str]:
    """Lines naming the files and S3 objects of the sources that differ between two data reports' ``sources``
    (``Mix.describe()``): a changed hash, size or ETag, one gone, one new."""

    def parts(described: list[dict]) -> dict[str, tuple]:
        out = {}
        for source in described:
            identity = source.get("identity") or {}
            for f in identity.get("files") or []:
                out[f["path"]] = ("content hash", f.get("hash"), f.get("size"))
            for o in identity.get("objects") or []:
                out[f"s3://{identity.get('bucket')}/{o.get('key')}"] = ("ETag", o.get("etag"), o.get("size"))
        return out

    old, new = parts(before), parts(now)
    lines = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if b is None:
            lines.append(f"data file {name} is gone")
        elif a is None:
            lines.append(f"data file {name} is new")
        elif (a[1] is not None and a[1] != b[1]) or a[2] != b[2]:  # an older report has no file hashes
            lines.append(f"data file {name} changed ({a[0]} {a[1]} -> {b[1]}, {a[2]} -> {b[2]} bytes)")
    return lines


AUTO_PARALLEL_MIN_BYTES = 16_000_000

"""Data below this size is tokenized in the calling process: a pool starts seconds later (each spawned process
unpickles the tokenizer, importing transformers), which only data past about this size wins back on many cores
(docs/PERFORMANCE.md, "The tokenizer pool"; scripts/bench_tokenize.py)."""


AUTO_MAX_PROC = 16

"""The most processes chosen unasked: each costs seconds to start and holds its own tokenizer; the parent, which
reads the rows and gathers the results, would feed more (~80, docs/PERFORMANCE.md), unmeasured past 16."""


def auto_num_proc(data: str | Path | Mix, cores: int | None = None) -> int:
    """Tokenizing processes for ``data`` on this machine: 1 for small data or few cores, else up to 16."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        size = _data_bytes(data)
    except OSError:
        return 1
    if cores < 4 or size < AUTO_PARALLEL_MIN_BYTES:
        return 1
    return min(cores, AUTO_MAX_PROC)


def _data_bytes(data: str | Path | Mix) -> int:
    """Bytes of text to tokenize, roughly: Parquet and compressed JSONL count 3x (text compresses about that much),
    a limited or sampled source only its share."""
    if isinstance(data, Mix):
        total = 0
        for s in data.sources:
            if s.dataset is not None:
                size = int(s.dataset.data.nbytes)
            else:
                size = sum(_data_bytes(f) for f in s.files)
            share = s.spec.fraction or 1.0
            if s.dataset is not None and (s.spec.limit or s.spec.sample):
                share = min(1.0, (s.spec.limit or s.spec.sample) / max(1, len(s.dataset)))
            total += int(size * share)
        return total
    path = Path(data)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    compressed = path.name.lower().endswith((".parquet", ".gz", ".zst"))
    return path.stat().st_size * (3 if compressed else 1)
