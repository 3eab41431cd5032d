"""What a training dataset is given, checked: its arguments where it is made, a resume state where it is loaded.

A resume state comes back from a checkpoint file anyone can edit, so nothing in it is trusted: exact keys, types,
ranges, identity and a checksum over the rest (an edit that fits every range is still refused). A state without a
checksum passes on its fields alone, so a job resumes across an upgrade. A misfit raises ``StateError`` naming it.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Callable, Mapping

from hsextract.errors import HsextractError


class StateError(HsextractError):
    """A resume state that does not fit this dataset; ``field`` names the part that does not."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"resume state, field {field!r}: {problem}")

    def __reduce__(self):  # raised in DataLoader workers: rebuilt from its fields in the main process
        return type(self), (self.field, self.problem)


# -- arguments ----------------------------------------------------------------------------------------------------
def whole(name: str, value, minimum: int = 0) -> int:
    """An integer argument of at least ``minimum`` (not a bool, a float or a string)."""
    if not is_int(value) or value < minimum:
        raise HsextractError(f"{name} must be an integer of at least {minimum}, got {value!r}")
    return int(value)


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise HsextractError(f"{name} must be True or False, got {value!r}")
    return value


def seconds(name: str, value) -> float:
    """A positive, finite number of seconds (a nan would wait forever, an inf never time out)."""
    ok = (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
    if not ok:
        raise HsextractError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def optional_text(name: str, value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise HsextractError(f"{name} must be a string or None, got {value!r}")
    return value


def check_where(where) -> None:
    """The reading arguments of a dataset (``index.Where``), each of its type; the cache limit positive and
    finite."""
    import os

    import torch

    from hsextract.storage.cache import cache_limit

    optional_text("endpoint_url", where.endpoint_url)
    flag("verify", where.verify)
    if not isinstance(where.dtype, torch.dtype):
        raise HsextractError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), got {where.dtype!r}")
    seconds("retry_deadline_s", where.retry_deadline_s)
    if where.cache_dir is not None and not isinstance(where.cache_dir, (str, os.PathLike)):
        raise HsextractError(f"cache_dir must be a directory or None, got {where.cache_dir!r}")
    cache_limit(where.cache_max_gb)


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# -- resume states ------------------------------------------------------------------------------------------------
Check = Callable[[object], str | None]

"""A field's check: None when the value fits, else what is wrong with it, in words."""


def count(lo: int = 0, hi: int | None = None) -> Check:
    """An int in ``lo..hi``."""

    def check(v) -> str | None:
        if not is_int(v):
            return f"must be an integer, got {v!r}"
        if v < lo or (hi is not None and v > hi):
            return f"{v} is not in {lo}..{hi}" if hi is not None else f"{v} is below {lo}"
        return None

    return check


def anything(v) -> None:
    """For the identity fields, compared with this dataset's own (type and value) instead."""
    return None


def checksum(state: Mapping) -> str:
    """A hash of every field but ``checksum`` itself, as JSON (how a checkpoint stores it)."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def sealed(state: dict) -> dict:
    """``state`` with its checksum."""
    return {**state, "checksum": checksum(state)}


def as_state(state, what: str) -> Mapping:
    if not isinstance(state, Mapping):
        raise StateError(
            "state",
            f"must be the dict {what}.state_dict() returned, got {type(state).__name__} {state!r:.80}",
        )
    return state


def check_state(state, fields: Mapping[str, Check], mine: Mapping, what: str) -> None:
    """Refuse ``state`` unless it has exactly ``fields`` (and perhaps a checksum), the fields of ``mine`` (this
    dataset's identity) are equal, each field passes its check, and a checksum given matches; the first that fails
    is named."""
    state = as_state(state, what)
    missing = [k for k in fields if k not in state]
    if missing:
        raise StateError(
            missing[0],
            f"missing (the state lacks {', '.join(missing)}): give the dict {what}.state_dict() made",
        )
    unknown = sorted(str(k) for k in state if k not in fields and k != "checksum")
    if unknown:
        raise StateError(unknown[0], f"not a field of a {what} state (known: {', '.join(fields)})")
    for name, value in mine.items():
        if state[name] != value or type(state[name]) is not type(value):
            raise StateError(
                name,
                f"this state was taken with {name}={state[name]!r}, this {what} has {name}={value!r}: resume "
                f"with the same output and the same {', '.join(mine)}",
            )
    for name, check in fields.items():  # in order: a later check may rely on an earlier field
        problem = check(state[name])
        if problem is not None:
            raise StateError(name, problem)
    if "checksum" in state and state["checksum"] != checksum(state):
        raise StateError(
            "checksum",
            f"{state['checksum']!r} does not match the state's fields: the state was edited or damaged after "
            "state_dict() made it; resume from an unedited checkpoint",
        )
