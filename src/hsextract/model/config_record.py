"""What preparation reads of the model's config, recorded in the user's cache so that a later launch reads no config
through transformers, whose import (with torch) was most of a resume's CPU.

A record is keyed by the path and bytes of ``config.json``, the transformers version and ``RECORD_VERSION``; it
is sealed, names the config's sha256 and must agree with every field the config file states, so one model's or an
edited record never changes a run's layers, shapes or vocabulary. One that fails is written again from the config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

from hsextract.errors import HsextractError
from hsextract.model.load import load_model_config
from hsextract.storage.fileio import write_json
from hsextract.validation import seal, seal_problem

log = logging.getLogger(__name__)

RECORD_VERSION = 2

FIELDS = {
    "num_hidden_layers": int,
    "hidden_size": int,
    "vocab_size": (int, type(None)),
    "layer_types": (list, type(None)),
    "final_logit_softcapping": (int, float, type(None)),
    "logit_scale": (int, float, type(None)),
    "model_type": (str, type(None)),
}

"""The text config's attributes preparation reads, and their types in a record."""


class ConfigView(SimpleNamespace):
    """A recorded config: its attributes, and ``get_text_config()`` as a transformers config has."""

    def get_text_config(self):
        return self


def _config_file(model: str) -> tuple[Path, bytes] | None:
    """The model's ``config.json`` (its resolved path) and bytes, or None for a Hub id or a directory without one."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    try:
        return config.resolve(), config.read_bytes()
    except OSError:
        return None


def _key(model: str) -> str | None:
    found = _config_file(model)
    return None if found is None else _key_of(*found)


def _key_of(path: Path, data: bytes) -> str:
    h = hashlib.sha256(
        f"{RECORD_VERSION}\0transformers={metadata.version('transformers')}\0{path}\0".encode()
    )
    h.update(data)
    return h.hexdigest()[:24]


def _valid(record) -> bool:
    """A record holds ``FIELDS`` exactly, of their types (no bool for a number, no NaN or infinity), counts and sizes
    positive, and layer types for every layer."""
    if not isinstance(record, dict) or set(record) != set(FIELDS):
        return False
    if not all(isinstance(record[k], t) and not isinstance(record[k], bool) for k, t in FIELDS.items()):
        return False
    if any(isinstance(v, float) and not math.isfinite(v) for v in record.values()):
        return False
    if record["hidden_size"] < 1 or (record["vocab_size"] is not None and record["vocab_size"] < 1):
        return False
    layer_types = record["layer_types"]
    return record["num_hidden_layers"] >= 1 and (
        layer_types is None
        or (len(layer_types) == record["num_hidden_layers"] and all(isinstance(t, str) for t in layer_types))
    )


def _stated(data: bytes) -> dict:
    """The ``FIELDS`` the config file states itself (in its ``text_config`` when it has one)."""
    try:
        raw = json.loads(data)
    except ValueError:
        return {}
    if not isinstance(raw, dict):
        return {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return {name: text[name] for name in FIELDS if name in text}


def _read(path: Path, config: tuple[Path, bytes]) -> dict | None:
    """The record's fields if the file is a sealed record of this very config file, agreeing with what the file
    states (a damaged, edited or another model's record is ignored: the config is read again)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if seal_problem(record) is not None:
        return None
    config_path, data = config
    if record.get("config_file") != str(config_path) or record.get("config_sha256") != _sha256(data):
        return None
    fields = record.get("fields")
    if not _valid(fields) or any(fields[k] != v for k, v in _stated(data).items()):
        return None
    return fields


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def recorded_model_config(model: str, record_dir: Path | None, trust_remote_code: bool = False):
    """``(config, text_config, num_layers)`` as ``load_model_config`` gives them, from the record in ``record_dir``
    when ``config.json`` matches one, else read through transformers (and recorded). A recorded config has only
    ``FIELDS`` (and no ``_commit_hash``: a local directory's config has none)."""
    config_file = _config_file(model) if record_dir is not None else None
    key = _key_of(*config_file) if config_file is not None else None
    path = None if key is None else Path(record_dir) / f"model-config-{key}.json"
    record = _read(path, config_file) if path is not None and path.is_file() else None
    if record is not None:
        view = ConfigView(**record)
        return view, view, view.num_hidden_layers
    config, text, num_layers = load_model_config(model, trust_remote_code)
    if path is not None:
        values = {name: getattr(text, name, None) for name in FIELDS}
        values["layer_types"] = list(values["layer_types"]) if values["layer_types"] is not None else None
        config_path, data = config_file
        if _recordable(values) and all(values[k] == v for k, v in _stated(data).items()):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(
                    path,
                    seal({"config_file": str(config_path), "config_sha256": _sha256(data), "fields": values}),
                )
            except (OSError, HsextractError) as e:  # a record saves time, its absence costs none
                log.warning("the model's config is not recorded (%s): it is read again next time", e)
    return config, text, num_layers


def _recordable(values: dict) -> bool:
    """Only values a record holds exactly and reads back (a config of odd types is read through transformers every
    time)."""
    try:
        return json.loads(json.dumps(values)) == values and _valid(values)
    except (TypeError, ValueError):
        return False
