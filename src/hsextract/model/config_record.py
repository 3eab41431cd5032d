"""What preparation reads of the model's config, recorded (in the user's cache, prepare/tokenizer_record.records_dir)
so that a later launch reads no config through transformers: its import (which imports torch) was most of a resume's
CPU (6.6 -> 2.5 CPU-s for a finished tiny job).

A record is found by the bytes of ``config.json``, the transformers version that read it and ``RECORD_VERSION``;
a model given as a Hub id has none. It holds the values of the attributes preparation reads (``FIELDS``), as the
loaded config gave them, defaults included: the run files and the plan are the same with a record or without.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

from hsextract.model.load import load_model_config
from hsextract.storage.fileio import write_json

RECORD_VERSION = 1

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


def _key(model: str) -> str | None:
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    h = hashlib.sha256(f"{RECORD_VERSION}\0transformers={metadata.version('transformers')}\0".encode())
    h.update(config.read_bytes())
    return h.hexdigest()[:24]


def _valid(record) -> bool:
    """A record holds ``FIELDS`` exactly, of their types (no bool for a number), and layer types for every layer."""
    if not isinstance(record, dict) or set(record) != set(FIELDS):
        return False
    if not all(isinstance(record[k], t) and not isinstance(record[k], bool) for k, t in FIELDS.items()):
        return False
    layer_types = record["layer_types"]
    return record["num_hidden_layers"] >= 1 and (
        layer_types is None
        or (len(layer_types) == record["num_hidden_layers"] and all(isinstance(t, str) for t in layer_types))
    )


def _read(path: Path) -> dict | None:
    """The record's fields if the file is one (a damaged or edited file is ignored: the config is read again)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if _valid(record) else None


def recorded_model_config(model: str, record_dir: Path | None, trust_remote_code: bool = False):
    """``(config, text_config, num_layers)`` as ``load_model_config`` gives them, from the record in ``record_dir``
    when ``config.json`` matches one, else read through transformers (and recorded). A recorded config has only
    ``FIELDS`` (and no ``_commit_hash``: a local directory's config has none)."""
    key = _key(model) if record_dir is not None else None
    path = None if key is None else Path(record_dir) / f"model-config-{key}.json"
    record = _read(path) if path is not None and path.is_file() else None
    if record is not None:
        view = ConfigView(**record)
        return view, view, view.num_hidden_layers
    config, text, num_layers = load_model_config(model, trust_remote_code)
    if path is not None:
        values = {name: getattr(text, name, None) for name in FIELDS}
        values["layer_types"] = list(values["layer_types"]) if values["layer_types"] is not None else None
        if _recordable(values):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, values)
    return config, text, num_layers


def _recordable(values: dict) -> bool:
    """Only values a record holds exactly and reads back (a config of odd types is read through transformers every
    time)."""
    try:
        return json.loads(json.dumps(values)) == values and _valid(values)
    except (TypeError, ValueError):
        return False
