"""What preparation needs of the model's tokenizer (its fingerprint and pad id), recorded beside the token cache, so
that a launch from the cache loads no tokenizer: a 248k-vocabulary one costs seconds to import, load and hash.

A record is found by the tokenizer's files: the name, size and bytes of every file of the model directory but the
weights, the versions of transformers and tokenizers that read them, and ``RECORD_VERSION`` (bump it when
``load_tokenizer`` changes what it makes of them). Whatever could change the loaded tokenizer changes that key,
so a record is never used for a tokenizer it was not made from; a model given as a Hub id has no record. The
values are those of ``tokenizer_fingerprint`` on the loaded tokenizer: the cache key and the plan are the same with
a record or without.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

from hsextract.prepare.tokenize import load_tokenizer, tokenizer_fingerprint
from hsextract.storage.fileio import write_json

RECORD_VERSION = 1


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

"""Files of a model directory that hold weights: never read for the tokenizer's key (tens of GB)."""


def files_key(model: str) -> str | None:
    """A hash of what the tokenizer of ``model`` is made from; None when ``model`` is not a local directory."""
    path = Path(model)
    if not path.is_dir():
        return None
    h = hashlib.sha256(f"{RECORD_VERSION}".encode())
    for package in ("transformers", "tokenizers"):
        h.update(f"\0{package}={metadata.version(package)}".encode())
    for file in sorted(p for p in path.iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)):
        h.update(f"\0{file.name}\0{file.stat().st_size}\0".encode())
        h.update(file.read_bytes())
    return h.hexdigest()[:24]


def _read(path: Path | None) -> dict | None:
    """The record at ``path`` if it is one (a damaged or edited file is ignored: the tokenizer is loaded)."""
    if path is None or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    fingerprint = record.get("fingerprint") if isinstance(record, dict) else None
    valid = (
        isinstance(fingerprint, dict)
        and set(fingerprint) == {"tokenizer_hash", "chat_template_hash"}
        and all(isinstance(v, str) for v in fingerprint.values())
        and (record.get("pad_token_id") is None or isinstance(record.get("pad_token_id"), int))
    )
    return record if valid else None


class RecordedTokenizer:
    """The model's tokenizer as preparation uses it: ``recorded_fingerprint()`` and ``pad_token_id`` from the record
    in ``record_dir`` when the tokenizer's files match one, else from the tokenizer, loaded then (and recorded);
    ``load()`` gives the tokenizer itself, for tokenizing."""

    def __init__(self, model: str, record_dir: Path | None):
        self.model = model
        key = files_key(model) if record_dir is not None else None
        self.path = None if key is None else Path(record_dir) / f"tokenizer-{key}.json"
        self._record = _read(self.path)
        self._tokenizer = None

    def load(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model)
            self._record = {
                "fingerprint": tokenizer_fingerprint(self._tokenizer),
                "pad_token_id": self._tokenizer.pad_token_id,
            }
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_json(self.path, self._record)
        return self._tokenizer

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def recorded_fingerprint(self) -> dict:
        """``tokenizer_fingerprint`` of the tokenizer."""
        if self._record is None:
            self.load()
        return dict(self._record["fingerprint"])

    @property
    def pad_token_id(self) -> int | None:
        if self._record is None:
            self.load()
        return self._record["pad_token_id"]
