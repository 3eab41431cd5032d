"""JSON records read back into their dataclasses, every field checked against its annotation by pydantic (strict:
no "8" for 8, no 1 for True; unknown keys refused where the class says so), so that a damaged or hand-edited file
is refused naming the field's path instead of passing a wrong type on."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

MAX_LISTED = 4

"""Problems named in one message: the first few say what happened."""


@cache
def _adapter(cls):
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def problems(error) -> str:
    """A pydantic ``ValidationError`` as ``path: what`` items, e.g. ``layer_ids.2: Input should be a valid
    integer``."""
    found = error.errors(include_url=False)
    items = [_problem(e) for e in found[:MAX_LISTED]]
    more = f" (and {len(found) - MAX_LISTED} more)" if len(found) > MAX_LISTED else ""
    return "; ".join(items) + more


def _problem(e: dict) -> str:
    where = ".".join(map(str, e["loc"])) or "(the record)"
    if e["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"{where}: unknown key"
    if e["type"] == "missing" or "input" not in e or isinstance(e["input"], (dict, list)):
        return f"{where}: {e['msg']}"
    return f"{where}: {e['msg']}, got {e['input']!r:.40}"


def parse(cls, data: Any, on_error):
    """``cls`` from the JSON value ``data`` (parsed, or its text), checked field by field; a record that does not
    fit raises ``on_error(problems)``."""
    from pydantic import ValidationError

    text = data if isinstance(data, (str, bytes)) else json.dumps(data)
    try:
        return _adapter(cls).validate_json(text, strict=True)
    except ValidationError as e:
        raise on_error(problems(e)) from None


# -- records that prove themselves ---------------------------------------------------------------------------------
SEAL_KEY = "checksum"

"""The key under which a JSON record hsextract writes carries the checksum of its own content (``seal``)."""


def content_checksum(value: Any) -> str:
    """sha256 of ``value``'s canonical JSON (sorted keys, no spaces): the same for the value and its reading back."""
    import hashlib

    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def seal(record: dict) -> dict:
    """``record`` with the checksum of the rest of its content under ``SEAL_KEY``: an edit of any field, even a
    right-typed one, is then seen by ``unseal``."""
    body = {k: v for k, v in record.items() if k != SEAL_KEY}
    return {**body, SEAL_KEY: content_checksum(body)}


def seal_problem(record: Any, *, required: bool = True) -> str | None:
    """Why ``record`` does not prove itself (not an object, no checksum where one is ``required``, or one that does
    not match its content), or None."""
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    if SEAL_KEY not in record:
        return "it carries no checksum of its content" if required else None
    body = {k: v for k, v in record.items() if k != SEAL_KEY}
    if record[SEAL_KEY] != content_checksum(body):
        return "its content does not match its checksum (edited or damaged)"
    return None


def unseal(record: Any, on_error, *, required: bool = True) -> dict:
    """The content of a sealed ``record`` (its checksum removed); one that does not prove itself raises
    ``on_error(problem)``. ``required=False`` accepts a record without a checksum (written before records carried
    one)."""
    if (problem := seal_problem(record, required=required)) is not None:
        raise on_error(problem)
    return {k: v for k, v in record.items() if k != SEAL_KEY}
