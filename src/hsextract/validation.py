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
