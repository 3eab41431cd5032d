"""A source spec parsed: its location and options (``convs/*.jsonl?limit=500&name=chat``, or a YAML mapping), each
option checked by name before anything is read. sources.py resolves a spec to the rows it names.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from hsextract.errors import HsextractError, redact

OPTION_NAMES = ("name", "split", "config", "revision", "limit", "fraction", "sample", "columns")


COLUMN_FIELDS = ("messages", "conversations", "id", "input_ids", "loss_mask", "text", "tools", "system")


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class SourceSpec:
    """One ``--data`` entry, parsed; nothing is read yet."""

    location: str
    name: str | None = None
    split: str | None = None
    config: str | None = None
    revision: str | None = None
    limit: int | None = None
    fraction: float | None = None
    sample: int | None = None
    columns: tuple[tuple[str, str], ...] = ()
    """``(field, column)`` pairs: the row's ``column`` is read as ``field``."""

    def options(self) -> dict:
        """The options given (not the defaults), for the fingerprint and the data report."""
        out = {k: getattr(self, k) for k in OPTION_NAMES if k != "columns" and getattr(self, k) is not None}
        if self.columns:
            out["columns"] = dict(self.columns)
        return out


def parse_sources(data) -> tuple[SourceSpec, ...]:
    """``--data`` values or the YAML ``data:`` list (one string or mapping, or a list of them) as specs."""
    if isinstance(data, (str, Path, Mapping, SourceSpec)):
        data = [data]
    specs = tuple(parse_source(d) for d in data)
    if not specs:
        raise HsextractError("no data source given: pass --data PATH (several times for a mix)")
    return specs


def parse_source(spec) -> SourceSpec:
    """A spec from a string (options as a query string after the last ``?``) or a mapping (``path`` + options)."""
    if isinstance(spec, SourceSpec):
        return spec
    if isinstance(spec, Path):
        spec = str(spec)
    if isinstance(spec, Mapping):
        spec = dict(spec)
        location = spec.pop("path", None) or spec.pop("source", None)
        if not isinstance(location, str) or not location:
            raise HsextractError(
                f"data source {spec!r} has no 'path': give path: FILE, GLOB, DIR, hf:ID or s3://..."
            )
        return _with_options(location, spec, location)
    if not isinstance(spec, str) or not spec.strip():
        raise HsextractError(f"data source {spec!r} is not a path, glob, hf:ID or s3:// URL")
    location, options = spec.strip(), {}
    head, sep, tail = location.rpartition("?")
    if sep and "=" in tail and not Path(location).exists():  # a '?' without '=' is a glob wildcard
        try:
            pairs = parse_qsl(tail, keep_blank_values=True, strict_parsing=True)
        except ValueError as e:
            raise HsextractError(f"data source {spec!r}: cannot parse the options {tail!r} ({e})") from None
        location, options = head, dict(pairs)
        if not location.strip():
            raise HsextractError(
                f"data source {spec!r} has options but no path: write PATH?{tail} (a file, glob, directory, "
                "hf:ID or s3:// URL before the '?')"
            )
    return _with_options(location, options, spec)


def _with_options(location: str, options: dict, given) -> SourceSpec:
    if redact(location) != location:
        # The spec is stored in the run dir's config and data report and printed in messages: no secret goes in.
        raise HsextractError(
            f"data source {redact(location)!r} carries credentials in its URL: they are not accepted there (the "
            "run dir, the data report and the logs would keep them). Give them as AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or an AWS profile, and write the URL without them"
        )
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise HsextractError(
            f"data source {given!r}: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTION_NAMES)}"
        )
    values: dict[str, Any] = {}
    for key in ("name", "split", "config", "revision"):
        if options.get(key) is not None:
            values[key] = str(options[key])
    for key in ("limit", "sample"):
        if options.get(key) is not None:
            values[key] = _positive_int(options[key], key, given)
    if options.get("fraction") is not None:
        try:
            fraction = float(options["fraction"])
        except (TypeError, ValueError):
            fraction = float("nan")
        if not 0 < fraction <= 1:
            raise HsextractError(
                f"data source {given!r}: fraction must be in (0, 1], got {options['fraction']!r}"
            )
        values["fraction"] = fraction
    chosen = [k for k in ("limit", "fraction", "sample") if k in values]
    if len(chosen) > 1:
        raise HsextractError(
            f"data source {given!r}: give one of limit, fraction, sample, not {' and '.join(chosen)}"
        )
    if options.get("columns") is not None:
        values["columns"] = _columns(options["columns"], given)
    if "name" in values and not _NAME.match(values["name"]):
        raise HsextractError(
            f"data source {given!r}: name {values['name']!r} must be letters, digits, '.', '_' or '-' "
            "(it prefixes the sample ids as NAME/ID)"
        )
    return SourceSpec(location=location, **values)


def _positive_int(value, key: str, given) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number < 1 or str(number) != str(value).strip():
        raise HsextractError(f"data source {given!r}: {key} must be a positive integer, got {value!r}")
    if number > sys.maxsize:
        raise HsextractError(
            f"data source {given!r}: {key}={value} is larger than any source can hold (at most {sys.maxsize}): "
            f"drop {key} to take every row"
        )
    return number


def _columns(value, given) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):
        pairs = []
        for part in value.split(","):
            target, sep, column = part.partition(":")
            if not sep or not target.strip() or not column.strip():
                raise HsextractError(
                    f"data source {given!r}: columns must be FIELD:COLUMN,... (e.g. messages:conversation), "
                    f"got {value!r}"
                )
            pairs.append((target.strip(), column.strip()))
    elif isinstance(value, Mapping):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        raise HsextractError(f"data source {given!r}: columns must be a mapping FIELD: COLUMN, got {value!r}")
    bad = [t for t, _ in pairs if t not in COLUMN_FIELDS]
    if bad:
        raise HsextractError(
            f"data source {given!r}: columns names unknown field(s) {', '.join(bad)}; fields are "
            f"{', '.join(COLUMN_FIELDS)}"
        )
    return tuple(pairs)
