"""What preparation needs of the model's tokenizer (its fingerprint and pad id), recorded with the tokenizer's
snapshot, so that a launch from the token cache loads no tokenizer and one that tokenizes imports no transformers.

A record is keyed by every file of the model directory but the weights, the library versions and
``RECORD_VERSION`` (bump it when ``load_tokenizer`` changes), sealed, and checked against the files' digest before
use; a record that fails any check is ignored and the tokenizer is loaded through transformers and recorded again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib import metadata
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.hub import WEIGHT_SUFFIXES
from hsextract.prepare.fast_tokenizer import PROBE, direct_backend
from hsextract.prepare.snapshot_tokenizer import SnapshotTokenizer, valid_snapshot
from hsextract.prepare.tiktoken_bpe import disabled, spec_from_json, spec_of, spec_to_json
from hsextract.prepare.tokenize import load_tokenizer, tokenizer_fingerprint
from hsextract.storage.fileio import atomic_write, user_cache_dir, write_json
from hsextract.validation import seal, seal_problem

log = logging.getLogger(__name__)

RECORD_VERSION = 2


def records_dir(run_cache: Path) -> Path:
    """Where the model's records (its tokenizer's and config's) are kept: in the user's cache, for every job of this
    machine, else in the run dir's cache ``run_cache``."""
    return user_cache_dir("models", Path(run_cache))


def files_key(model: str) -> str | None:
    """A hash of what the tokenizer of ``model`` is made from; None when ``model`` is not a local directory."""
    digest = files_digest(model)
    return None if digest is None else digest[:24]


def files_digest(model: str) -> str | None:
    """The full sha256 of what the tokenizer of ``model`` is made from (``files_key`` is its first 24 digits)."""
    path = Path(model)
    if not path.is_dir():
        return None
    h = hashlib.sha256(f"{RECORD_VERSION}".encode())
    for package in ("transformers", "tokenizers"):
        h.update(f"\0{package}={metadata.version(package)}".encode())
    for file in sorted(p for p in path.iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)):
        h.update(f"\0{file.name}\0{file.stat().st_size}\0".encode())
        h.update(file.read_bytes())
    return h.hexdigest()


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read(path: Path | None, files: str | None) -> dict | None:
    """The record at ``path`` if it proves itself as a record of the tokenizer files whose digest is ``files``
    (a damaged, edited or another model's record is ignored: the tokenizer is loaded)."""
    if path is None or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if seal_problem(record) is None and _valid(record, files) else None


def _valid(record: dict, files: str | None) -> bool:
    """A record of the files whose digest is ``files``, each field of its type, the pad id in the vocabulary."""
    if record.get("files_sha256") != files:
        return False
    fingerprint, pad, size = record.get("fingerprint"), record.get("pad_token_id"), record.get("vocab_size")
    return (
        isinstance(fingerprint, dict)
        and set(fingerprint) == {"tokenizer_hash", "chat_template_hash"}
        and all(isinstance(v, str) for v in fingerprint.values())
        and _is_id(size)
        and _is_id(pad)
        and 0 <= pad < size
        and (record.get("snapshot_sha256") is None or isinstance(record.get("snapshot_sha256"), str))
        and (record.get("tiktoken_sha256") is None or isinstance(record.get("tiktoken_sha256"), str))
    )


def _kept_or_said(write, path: Path) -> bool:
    """``write()``; a record that cannot be written (a full disk, a directory in its place) is said, never fatal:
    it saves time, its absence costs none."""
    try:
        write()
    except (OSError, HsextractError) as e:
        log.warning(
            "the tokenizer's record %s is not kept (%s): the tokenizer is loaded again next time", path, e
        )
        return False
    return True


class RecordedTokenizer:
    """The model's tokenizer as preparation uses it: ``recorded_fingerprint()`` and ``pad_token_id`` from the record
    in ``record_dir`` when the tokenizer's files match one, else from the tokenizer, loaded then (and recorded);
    ``load()`` gives the tokenizer itself, for tokenizing."""

    def __init__(
        self, model: str, record_dir: Path | None, trust_remote_code: bool = False, echo=None, flag="--model"
    ):
        self.model = model
        self.flag = flag
        """The option that named ``model`` (``--model``, ``--tokenizer``): a load that fails names it."""
        self.trust_remote_code = trust_remote_code
        self.echo = echo or (lambda line: log.info("%s", line))
        """Where the slow first use of a tokenizer says what it does (tens of seconds for a real one)."""
        self.files = files_digest(model) if record_dir is not None else None
        key = None if self.files is None else self.files[:24]
        self.path = None if key is None else Path(record_dir) / f"tokenizer-{key}.json"
        self.snapshot_path = None if key is None else Path(record_dir) / f"tokenizer-{key}.snapshot.json"
        self.tiktoken_path = None if key is None else Path(record_dir) / f"tokenizer-{key}.tiktoken.json"
        self._record = _read(self.path, self.files)
        self._tokenizer = None

    def load(self):
        """The tokenizer: rebuilt from its snapshot when there is one of the recorded tokenizer, else loaded through
        transformers (recorded, and its snapshot taken: the tokenizer given is the snapshot's when one is)."""
        if self._tokenizer is None:
            self._tokenizer = self._from_snapshot()
        if self._tokenizer is None:
            self.echo(
                "tokenizer: loading it through transformers and recording it (the first use of these tokenizer "
                "files; later runs read the record)"
            )
            tokenizer = load_tokenizer(self.model, self.trust_remote_code, self.flag)
            self._record = {
                "files_sha256": self.files,
                "fingerprint": tokenizer_fingerprint(tokenizer),
                "pad_token_id": tokenizer.pad_token_id,
                "vocab_size": len(tokenizer),
            }
            snapshot = take_snapshot(tokenizer)
            if self.path is not None:
                if snapshot is not None:
                    self._keep(self.snapshot_path, "snapshot_sha256", snapshot)
                self._write()
            self._tokenizer = tokenizer if snapshot is None else SnapshotTokenizer(snapshot)
        return self._tokenizer

    def _from_snapshot(self) -> SnapshotTokenizer | None:
        """The recorded tokenizer's snapshot; None when there is none, or the file is not the one recorded."""
        try:
            snapshot = self._kept(self.snapshot_path, "snapshot_sha256")
            return SnapshotTokenizer(snapshot) if valid_snapshot(snapshot) else None
        except Exception:  # an unreadable snapshot costs a load through transformers, never the run
            return None

    def tiktoken_spec(self):
        """``spec_of`` the tokenizer, kept beside its record as its snapshot is: the check encodes the whole
        vocabulary both ways (~12 CPU-s for a 248k one, at every launch that tokenizes). A missing, changed or other
        tiktoken's file is made again; the tokenizing still checks tiktoken as it goes."""
        if disabled():
            return None
        try:
            return spec_from_json(self._kept(self.tiktoken_path, "tiktoken_sha256"))
        except Exception:  # a missing or damaged file costs the check, never the run
            pass
        tokenizer = self.load()
        self.echo(
            f"tokenizer: checking the tiktoken fast path on its {len(tokenizer):,} tokens (once for these files)"
        )
        spec = spec_of(tokenizer)
        if self.path is not None:
            self._keep(self.tiktoken_path, "tiktoken_sha256", spec_to_json(spec))
            self._write()
        return spec

    def _write(self) -> None:
        """The record, sealed, only when it would be read back (a pad id outside the vocabulary never is)."""
        if _valid(self._record, self.files):
            _kept_or_said(lambda: write_json(self.path, seal(self._record)), self.path)

    def _keep(self, path: Path, digest_key: str, value) -> None:
        """``value`` as JSON at ``path``, its sha256 in the record under ``digest_key`` (the record is the caller's to
        write)."""
        text = json.dumps(seal({"files_sha256": self.files, "value": value}))
        if _kept_or_said(lambda: atomic_write(path, text, durable=False), path):
            self._record[digest_key] = hashlib.sha256(text.encode()).hexdigest()

    def _kept(self, path: Path | None, digest_key: str):
        """What ``_keep`` wrote at ``path``; ValueError when there is none or the file is not the one recorded."""
        digest = (self._record or {}).get(digest_key)
        if path is None or digest is None or not path.is_file():
            raise ValueError(f"no {path} recorded")
        text = path.read_bytes()
        if hashlib.sha256(text).hexdigest() != digest:
            raise ValueError(f"{path} is not the file recorded")
        kept = json.loads(text)
        if seal_problem(kept) is not None or kept.get("files_sha256") != self.files:
            raise ValueError(f"{path} is not a file of this tokenizer's files")
        return kept["value"]

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


_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


_PROBES = [
    ([{"role": "user", "content": "hsextract probe question"}], None),
    (
        [
            {"role": "system", "content": "Be brief. <b>&amp;</b> 数字"},
            {"role": "user", "content": "Hi!\n\n  there"},
            {"role": "assistant", "content": "<think>\nweighing it\n</think>\n\nHello."},
            {"role": "user", "content": "And the weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "21 degrees. ünïcödé\t end "},
        ],
        _TOOLS,
    ),
]

"""Conversations rendered both ways before a snapshot is kept: every prefix, with and without the generation
prompt, as preparation renders them."""


def _disagreement(tokenizer, snap: SnapshotTokenizer) -> str | None:
    """What the snapshot answers differently from ``tokenizer``, or None when it answers the same."""
    if direct_backend(tokenizer) is None:
        return "the tokenizer does not encode through its backend alone"
    for name in ("pad_token_id", "eos_token", "chat_template", "special_tokens_map"):
        if getattr(tokenizer, name) != getattr(snap, name):
            return name
    for name in ("__len__", "get_vocab", "get_added_vocab"):
        if getattr(tokenizer, name)() != getattr(snap, name)():
            return name
    if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(snap):
        return "fingerprint"
    probe = PROBE + " ".join(tokenizer.get_added_vocab())
    ours = snap.backend_tokenizer.encode(probe, add_special_tokens=False)
    theirs = tokenizer(probe, add_special_tokens=False, return_offsets_mapping=True)
    if ours.ids != list(theirs["input_ids"]) or ours.offsets != [tuple(o) for o in theirs["offset_mapping"]]:
        return "encoding"
    if tokenizer.chat_template is None:
        return None
    for messages, tools in _PROBES:
        for end in range(1, len(messages) + 1):
            for prompt in (False, True):
                renders = []
                for tok in (tokenizer, snap):
                    try:
                        renders.append(
                            tok.apply_chat_template(
                                messages[:end], tools=tools, tokenize=False, add_generation_prompt=prompt
                            )
                        )
                    except Exception as e:
                        renders.append(f"{type(e).__name__}: {e}")
                if renders[0] != renders[1]:
                    return f"the chat template's render of {end} message(s)"
    return None


def take_snapshot(tokenizer) -> dict | None:
    """The snapshot of a loaded transformers tokenizer, or None (and why, in the log) when its rebuilt tokenizer
    would answer differently."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    template = getattr(tokenizer, "chat_template", None)
    specials = getattr(tokenizer, "special_tokens_map", None)
    if (
        backend is None
        or backend.truncation is not None  # set in its files: the tokenizer's first call would change it
        or backend.padding is not None
        or not (template is None or isinstance(template, str))
        or not isinstance(specials, dict)
    ):
        log.info("loading the tokenizer through transformers each time: it has no single-template snapshot")
        return None
    snapshot = {"backend": backend.to_str(), "chat_template": template, "special_tokens_map": specials}
    try:
        if json.loads(json.dumps(snapshot)) != snapshot:
            return None
        differs = _disagreement(tokenizer, SnapshotTokenizer(snapshot))
    except Exception as e:  # a backend or template the snapshot cannot rebuild: transformers it is
        differs = f"{type(e).__name__}: {e}"
    if differs is not None:
        log.info("loading the tokenizer through transformers each time: its snapshot differs in %s", differs)
        return None
    return snapshot
