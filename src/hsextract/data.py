"""Dataset -> tokenized samples with a loss mask: the first stage of the pipeline.

A data path is a ``.jsonl`` file, a ``.json`` file (a list of rows, or ``{"data": [...]}``), a ``.parquet`` file, or
a directory written by ``datasets.Dataset.save_to_disk``. A row is one of three kinds, tried in this order:

- pre-tokenized: ``input_ids`` (list of ints) with an optional ``loss_mask`` (0/1, same length, default all ones);
  it is kept exactly as given, since it is what the user already tokenized;
- chat: ``messages`` (``{role, content, tool_calls?, reasoning?...}``) with optional row-level ``tools``;
- ShareGPT: ``conversations`` (``{from, value}``), mapped onto chat roles, with an optional row-level ``system``.

Bad rows never crash a run and are never dropped silently: each is classified as malformed, empty or too long,
counted in a ``DataReport`` (written next to the outputs by the caller) with a few examples. A run where no row
survives is an error, since extracting nothing is never what was meant.

The loss mask is 1 on what the assistant writes: the content of its turns (``<think>`` blocks and tool calls
included) and the end-of-turn token (``<|im_end|>``), 0 on system, user and tool turns and on the assistant header
(``<|im_start|>assistant\\n``), which the generation prompt supplies. Nothing about a template is hard-coded; the
mask is derived by rendering:

1. Render the whole conversation once and tokenize the text with character offsets. These are the ids the model
   sees, identical to ``apply_chat_template(tokenize=True)``.
2. For assistant message ``i``, the turn starts where ``render(messages[:i], add_generation_prompt=True)`` ends
   and stops where ``render(messages[:i + 1])`` ends, when both are prefixes of the full text; the end is then
   cut back to just after the end-of-turn marker, so a trailing newline is not learned.
3. Templates may rewrite history: Qwen's (and the demo's) drop ``<think>`` from assistant turns before the last
   user message, so a partial render is no longer a prefix of the full one. Such a turn is located in the full
   text instead: it starts after the next assistant header (or at the prefix end, when that one still matched)
   and ends at the end of the longest tail of its rendering that appears there (binary search on the tail
   length; a rewrite that drops the beginning of a turn keeps its tail). A turn that cannot be found makes the
   row malformed rather than giving it a wrong mask.
4. A token gets mask 1 when its character span overlaps an assistant span.

The assistant header and the end-of-turn marker used in steps 2 and 3 are themselves found by rendering a probe
conversation once per tokenizer (``ChatMarkers``).

Tokenization runs over ``num_proc`` spawned processes (spawn, not fork: the caller may hold threads or CUDA), in
chunks of rows in file order, so the result does not depend on ``num_proc``. With ``cache_dir`` the result and
its report are stored in one safetensors file whose name hashes the data bytes, the tokenizer, the chat template,
the length policy and ``FORMAT_VERSION`` (bump it whenever the encoding changes); a later call with the same
inputs loads that file instead of tokenizing again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from hsextract.errors import HsextractError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TOO_LONG_POLICIES = ("truncate", "skip")
ACCEPTED_FORMATS = ".jsonl, .json or .parquet file, or a directory written by datasets.Dataset.save_to_disk"
CHAT_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
EXAMPLES_PER_KIND = 5
"""Examples kept in the report for each of malformed, empty, too long and truncated (so at most 20)."""
CHUNK_ROWS = 64
"""Rows per task sent to a tokenizer process: large enough to amortise pickling, small for a smooth progress bar."""

_SKIP_KINDS = ("malformed", "empty", "too_long")
_PROBE_USER = "hsextract probe question"
_PROBE_REPLY = "hsextract probe answer"


@dataclass(frozen=True, eq=False)
class TokenizedSamples:
    """All kept samples concatenated: sample ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``."""

    sample_ids: list[str]
    """The row's ``id`` field as a string when present, else the row index."""
    input_ids: np.ndarray
    """int32 token ids of all samples, concatenated."""
    loss_mask: np.ndarray
    """uint8, 1 on tokens the drafter learns to predict (assistant turns), same length as ``input_ids``."""
    offsets: np.ndarray
    """int64, ``len(sample_ids) + 1`` entries, starting at 0 and ending at ``len(input_ids)``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sample_ids", [str(s) for s in self.sample_ids])
        object.__setattr__(self, "input_ids", np.ascontiguousarray(self.input_ids, dtype=np.int32))
        object.__setattr__(self, "loss_mask", np.ascontiguousarray(self.loss_mask, dtype=np.uint8))
        object.__setattr__(self, "offsets", np.ascontiguousarray(self.offsets, dtype=np.int64))
        n, ids, offsets = len(self.sample_ids), self.input_ids, self.offsets
        if ids.ndim != 1 or self.loss_mask.shape != ids.shape:
            raise ValueError(f"input_ids {ids.shape} and loss_mask {self.loss_mask.shape} must be equal 1-D")
        if (
            offsets.shape != (n + 1,)
            or offsets[0] != 0
            or offsets[-1] != len(ids)
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError(
                f"offsets must rise from 0 to {len(ids)} with {n + 1} entries, got {offsets[:8]}..."
            )

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample (int64)."""
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, loss_mask)`` of sample ``i``, as views into the concatenated arrays."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[start:end], self.loss_mask[start:end]

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file (tmp + rename: a file under its final name is complete)."""
        return self._save(Path(path), {})

    @classmethod
    def load(cls, path: str | Path) -> TokenizedSamples:
        return cls._load(Path(path))[0]

    def _save(self, path: Path, metadata: dict[str, str]) -> Path:
        from safetensors.numpy import save_file

        # Sample ids go in a byte tensor, not the header: safetensors caps the header at 100 MB.
        ids_json = np.frombuffer(json.dumps(self.sample_ids).encode(), dtype=np.uint8)
        tensors = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "offsets": self.offsets,
            "sample_ids_json": ids_json.copy(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"format": "hsextract.tokenized_samples", **metadata})
        os.replace(tmp, path)
        return path

    @classmethod
    def _load(cls, path: Path) -> tuple[TokenizedSamples, dict[str, str]]:
        from safetensors import safe_open
        from safetensors.numpy import load_file

        with safe_open(str(path), framework="numpy") as f:
            metadata = dict(f.metadata() or {})
        if metadata.get("format") != "hsextract.tokenized_samples":
            raise HsextractError(f"{path} is not a tokenized-samples file written by hsextract")
        tensors = load_file(str(path))
        samples = cls(
            sample_ids=json.loads(tensors["sample_ids_json"].tobytes().decode()),
            input_ids=tensors["input_ids"],
            loss_mask=tensors["loss_mask"],
            offsets=tensors["offsets"],
        )
        return samples, metadata


@dataclass(frozen=True)
class DataReport:
    """What became of each row of the data file; the caller writes ``to_json()`` into the run directory."""

    rows: int
    kept: int
    truncated: int
    """Kept rows cut to ``max_length`` tokens (counted in ``kept`` too)."""
    skipped_empty: int
    skipped_malformed: int
    skipped_too_long: int
    tokens: int
    """Kept tokens, after truncation."""
    max_length: int
    examples: list[dict] = field(default_factory=list)
    """A few ``{"row", "id", "kind", "reason"}`` for skipped and truncated rows, at most 5 of each kind."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> DataReport:
        return cls(**data)

    def summary(self) -> str:
        """One line for the console, e.g. ``300 rows: 297 kept (3 truncated to 2048 tokens), 2 empty, ...``."""
        kept = f"{self.kept} kept"
        if self.truncated:
            kept += f" ({self.truncated} truncated to {self.max_length} tokens)"
        parts = [kept]
        if self.skipped_empty:
            parts.append(f"{self.skipped_empty} empty")
        if self.skipped_malformed:
            parts.append(f"{self.skipped_malformed} malformed")
        if self.skipped_too_long:
            parts.append(f"{self.skipped_too_long} longer than {self.max_length} tokens skipped")
        return f"{self.rows} rows: {', '.join(parts)}; {self.tokens} tokens"


@dataclass(frozen=True)
class UnreadableRow:
    """A JSONL line that is not valid JSON; ``read_rows`` yields it in the line's place so that it is counted."""

    reason: str


# ---------------------------------------------------------------------------------------------------------------
# Reading rows


def _data_format(path: Path) -> str:
    if not path.exists():
        raise HsextractError(f"data path {path} does not exist; give a {ACCEPTED_FORMATS}")
    if path.is_dir():
        return "dataset_dir"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet"):
        return suffix[1:]
    raise HsextractError(
        f"cannot read {path}: unknown format {suffix or '(no extension)'!r}; give a {ACCEPTED_FORMATS}"
    )


def _open_rows(path: Path) -> tuple[Iterator[Any], int | None]:
    """The rows of ``path`` in order, and their count when known without a pass over the data."""
    kind = _data_format(path)
    if kind == "jsonl":
        return _jsonl_rows(path), None
    if kind == "json":
        rows = _json_rows(path)
        return iter(rows), len(rows)
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:
            raise HsextractError(f"cannot read {path} as parquet: {e}") from e
        batches = parquet.iter_batches(batch_size=1024)
        return (row for batch in batches for row in batch.to_pylist()), parquet.metadata.num_rows
    dataset = _load_dataset_dir(path)
    return _dataset_rows(dataset), len(dataset)


def _jsonl_rows(path: Path) -> Iterator[Any]:
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) hold no row
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield UnreadableRow(f"line {line_no} is not valid JSON ({e})")


def _json_rows(path: Path) -> list:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HsextractError(
            f"cannot parse {path} as JSON ({e}); a .jsonl file holds one row per line"
        ) from e
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise HsextractError(
            f'{path} must hold a JSON list of rows or {{"data": [...]}}, got {type(data).__name__}'
        )
    return data


def _load_dataset_dir(path: Path):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise HsextractError(
            f"cannot load directory {path} with datasets.load_from_disk ({e}); give a {ACCEPTED_FORMATS}"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            return loaded["train"]
        if len(splits) == 1:
            return loaded[splits[0]]
        raise HsextractError(
            f"{path} holds splits {splits} and none is 'train'; save the one to use on its own"
        )
    return loaded


def _dataset_rows(dataset) -> Iterator[dict]:
    for batch in dataset.with_format("arrow").iter(batch_size=1024):
        yield from batch.to_pylist()


def read_rows(path: str | Path) -> Iterator[Any]:
    """The rows of a data file in order; a JSONL line that is not JSON comes as an ``UnreadableRow``."""
    return _open_rows(Path(path))[0]


# ---------------------------------------------------------------------------------------------------------------
# Fingerprints and cache key


def tokenizer_fingerprint(tokenizer) -> dict:
    """Hashes of what decides the token ids: the tokenizer (with its special tokens) and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    # Templates render bos/eos by name, so the special-token map belongs to the tokenizer's identity.
    text += json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
    template = tokenizer.chat_template
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return {
        "tokenizer_hash": hashlib.sha256(text.encode()).hexdigest(),
        "chat_template_hash": hashlib.sha256(template.encode()).hexdigest(),
    }


def data_fingerprint(path: str | Path) -> str:
    """blake2b of the data bytes; for a directory, of every file's relative path and bytes, in sorted order.

    Memoized per (path, size, mtime) of each file: preparing a run asks for it twice (cache key and plan), and a
    large dataset takes seconds to hash."""
    path = Path(path)
    _data_format(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _data_fingerprint(path.resolve(), stamp)


@functools.lru_cache(maxsize=8)
def _data_fingerprint(path: Path, stamp: tuple) -> str:
    digest = hashlib.blake2b(digest_size=32)
    files = [Path(f) for f, _, _ in stamp]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        digest.update(str(file.stat().st_size).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def cache_file(cache_dir: Path, data_path, tokenizer, *, max_length: int, too_long: str) -> Path:
    """Where ``load_samples`` keeps (or finds) the tokenized samples for these inputs."""
    return (
        Path(cache_dir) / f"tokens-{_cache_key(Path(data_path), tokenizer, max_length, too_long)}.safetensors"
    )


def _cache_key(data_path: Path, tokenizer, max_length: int, too_long: str) -> str:
    parts = {
        "format_version": FORMAT_VERSION,
        "data": data_fingerprint(data_path),
        **tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "too_long": too_long,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------------------------
# One row -> (ids, mask)


class _RowSkipped(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def _malformed(reason: str) -> _RowSkipped:
    return _RowSkipped("malformed", reason)


def _drop_nones(value: Any) -> Any:
    """Remove None-valued keys: Arrow (parquet, datasets) fills keys a row lacks with None when rows differ."""
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nones(v) for v in value]
    return value


def _chat_messages(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise _malformed(f"'messages' is a {type(value).__name__}, not a list")
    messages = []
    for i, message in enumerate(_drop_nones(value)):
        if not isinstance(message, dict) or "role" not in message:
            raise _malformed(f"message {i} is not an object with a 'role'")
        role = message["role"]
        if role not in CHAT_ROLES:
            raise _malformed(
                f"message {i} has unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        if "content" not in message and role == "assistant" and message.get("tool_calls"):
            message = {**message, "content": ""}  # OpenAI style: content null next to tool calls
        if not isinstance(message.get("content"), str):
            raise _malformed(f"message {i} ({role}) has no string 'content'")
        messages.append(message)
    return messages


def _sharegpt_messages(value: Any, system: Any) -> list[dict]:
    if not isinstance(value, list):
        raise _malformed(f"'conversations' is a {type(value).__name__}, not a list")
    messages = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise _malformed(f"conversation turn {i} is not an object with 'from' and a string 'value'")
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise _malformed(
                f"conversation turn {i} has unknown 'from' {turn.get('from')!r}; "
                f"expected one of {', '.join(SHAREGPT_ROLES)}"
            )
        messages.append({"role": role, "content": turn["value"]})
    # A row-level system prompt (LLaMA-Factory's layout) applies unless the conversation opens with its own.
    if isinstance(system, str) and system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _tools(value: Any) -> list | None:
    if value is None:
        return None
    if isinstance(value, str):  # some exports store the tool list as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _malformed(f"'tools' is a string but not JSON ({e})") from e
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise _malformed("'tools' must be a list of objects")
    return _drop_nones(value) or None


@dataclass(frozen=True)
class ChatMarkers:
    """Template text found by rendering a probe conversation, used to cut and locate assistant turns."""

    generation_header: str
    """What ``add_generation_prompt`` appends, e.g. ``<|im_start|>assistant\\n``; empty for Mistral-style templates."""
    end_of_turn: str
    """First chunk the template writes after an assistant message, e.g. ``<|im_end|>``; may be empty."""

    @classmethod
    def probe(cls, tokenizer) -> ChatMarkers:
        user = [{"role": "user", "content": _PROBE_USER}]
        try:
            bare = tokenizer.apply_chat_template(user, tokenize=False)
            prompted = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            header = prompted[len(bare) :] if prompted.startswith(bare) else ""
        except Exception:
            header = ""
        try:
            text = tokenizer.apply_chat_template(
                [*user, {"role": "assistant", "content": _PROBE_REPLY}], tokenize=False
            )
        except Exception:
            return cls(header, "")
        after = text[text.rfind(_PROBE_REPLY) + len(_PROBE_REPLY) :].lstrip()
        chunk = after.split()[0] if after.split() else ""
        # "<|im_end|><|endoftext|>" -> "<|im_end|>": a chunk that opens with a special token ends with it.
        for token in sorted(tokenizer.get_added_vocab(), key=len, reverse=True):
            if token and chunk.startswith(token):
                return cls(header, token)
        return cls(header, chunk)


def _longest_tail_in(text: str, pattern: str, lo: int, hi: int) -> tuple[int, int]:
    """Length and position of the longest suffix of ``pattern`` found in ``text[lo:hi]``.

    Binary search is valid because a shorter suffix occurs wherever a longer one does.
    """
    best_len, best_pos = 0, -1
    low, high = 1, len(pattern)
    while low <= high:
        mid = (low + high) // 2
        pos = text.find(pattern[-mid:], lo, hi)
        if pos >= 0:
            best_len, best_pos, low = mid, pos, mid + 1
        else:
            high = mid - 1
    return best_len, best_pos


def _mask_from_spans(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens whose character range overlaps one of the sorted, disjoint ``spans``."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans or not len(offsets):
        return mask
    span_starts = np.array([s for s, _ in spans])
    span_ends = np.array([e for _, e in spans])
    tok_starts, tok_ends = offsets[:, 0], offsets[:, 1]
    first = np.searchsorted(span_ends, tok_starts, side="right")  # first span ending after the token starts
    valid = first < len(spans)
    overlaps = valid & (span_starts[np.minimum(first, len(spans) - 1)] < tok_ends) & (tok_ends > tok_starts)
    mask[overlaps] = 1
    return mask


class _RowEncoder:
    """Turns one row into ``(ids, mask)``, or raises ``_RowSkipped``; one per tokenizer process."""

    def __init__(self, tokenizer, max_length: int, too_long: str):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.too_long = too_long
        self.vocab_size = len(tokenizer)
        self.has_template = bool(tokenizer.chat_template)
        self.markers = ChatMarkers.probe(tokenizer) if self.has_template else ChatMarkers("", "")

    def encode(self, index: int, row: Any) -> tuple:
        """``(index, sample_id, status, reason, ids, mask)``; status is kept, truncated or a skip kind."""
        sample_id = str(index)
        if isinstance(row, dict) and row.get("id") is not None:
            sample_id = str(row["id"])
        try:
            ids, mask = self._encode(row)
            status, reason = "kept", ""
            if len(ids) > self.max_length:
                if self.too_long == "skip":
                    raise _RowSkipped("too_long", f"{len(ids)} tokens > max_length {self.max_length}")
                status, reason = "truncated", f"{len(ids)} tokens cut to {self.max_length}"
                ids, mask = ids[: self.max_length], mask[: self.max_length]
                if not mask.any():
                    raise _RowSkipped("empty", f"no assistant tokens in the first {self.max_length} tokens")
        except _RowSkipped as e:
            return index, sample_id, e.kind, e.reason, None, None
        except (
            Exception
        ) as e:  # one odd row must not end a run over millions; it is counted and shown instead
            return index, sample_id, "malformed", f"unexpected {type(e).__name__}: {e}", None, None
        return index, sample_id, status, reason, ids, mask

    def _encode(self, row: Any) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(row, UnreadableRow):
            raise _malformed(row.reason)
        if not isinstance(row, dict):
            raise _malformed(f"row is a {type(row).__name__}, not an object")
        if row.get("input_ids") is not None:
            return self._pretokenized(row["input_ids"], row.get("loss_mask"))
        if row.get("messages") is not None:
            messages = _chat_messages(row["messages"])
        elif row.get("conversations") is not None:
            messages = _sharegpt_messages(row["conversations"], row.get("system"))
        else:
            raise _malformed("row has none of the fields 'messages', 'conversations', 'input_ids'")
        return self._encode_chat(messages, _tools(row.get("tools")))

    def _pretokenized(self, ids: Any, mask: Any) -> tuple[np.ndarray, np.ndarray]:
        try:
            ids = np.asarray(ids)
            mask = None if mask is None else np.asarray(mask)
        except ValueError as e:  # ragged nesting
            raise _malformed(f"'input_ids' and 'loss_mask' must be flat lists ({e})") from e
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise _malformed("'input_ids' must be a flat list of integers")
        if not ids.size:
            raise _RowSkipped("empty", "'input_ids' is empty")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise _malformed(f"'input_ids' holds ids outside the tokenizer's range 0..{self.vocab_size - 1}")
        if mask is None:
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            if mask.shape != ids.shape:
                raise _malformed(f"'loss_mask' has {mask.size} entries for {ids.size} input_ids")
            if mask.dtype.kind not in "iub" or not np.isin(mask, (0, 1)).all():
                raise _malformed("'loss_mask' must hold only 0 and 1")
            mask = mask.astype(np.uint8)
            if not mask.any():
                raise _RowSkipped("empty", "'loss_mask' is all zeros")
        return ids.astype(np.int32), mask

    def _render(self, messages: list[dict], tools: list | None, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _try_render(self, messages: list[dict], tools: list | None, generation_prompt: bool) -> str | None:
        """A partial render; some templates reject partial conversations, which only costs the fast path."""
        try:
            return self._render(messages, tools, generation_prompt)
        except Exception:
            return None

    def _encode_chat(self, messages: list[dict], tools: list | None) -> tuple[np.ndarray, np.ndarray]:
        if not messages:
            raise _RowSkipped("empty", "the conversation has no messages")
        if not any(m["role"] == "assistant" and (m["content"] or m.get("tool_calls")) for m in messages):
            raise _RowSkipped("empty", "no assistant message with content")
        if not self.has_template:
            raise _malformed("the tokenizer has no chat template to render conversations with")
        try:
            full = self._render(messages, tools)
        except Exception as e:
            raise _malformed(f"the chat template failed: {type(e).__name__}: {e}") from e
        encoding = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"], dtype=np.int32)
        if not ids.size:
            raise _RowSkipped("empty", "the conversation renders to no tokens")
        offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = _mask_from_spans(offsets, self._assistant_spans(messages, tools, full))
        if not mask.any():
            raise _RowSkipped("empty", "no assistant tokens in the rendered conversation")
        return ids, mask

    def _assistant_spans(self, messages: list[dict], tools: list | None, full: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in ``full``, sorted and disjoint (see the module docstring)."""
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._try_render(messages[:i], tools, True) if i else None
            through = self._try_render(messages[: i + 1], tools, False)
            start = None
            if before is not None and len(before) >= cursor and full.startswith(before):
                start = len(before)
            if (
                start is not None
                and through is not None
                and len(through) > start
                and full.startswith(through)
            ):
                end = self._cut_after_end_of_turn(full, start, len(through))
            else:
                turn = None
                if before is not None and through is not None and through.startswith(before):
                    turn = through[len(before) :]
                start, end = self._locate_turn(full, cursor, start, turn, message, i)
            if end > start:
                spans.append((start, end))
                cursor = end
        return spans

    def _cut_after_end_of_turn(self, text: str, start: int, end: int) -> int:
        """End of the turn in ``text[start:end]``: just after its last end-of-turn marker, else before trailing space."""
        marker = self.markers.end_of_turn
        found = text.rfind(marker, start, end) if marker else -1
        if found >= 0:
            return found + len(marker)
        return start + len(text[start:end].rstrip())

    def _locate_turn(
        self, full: str, cursor: int, start: int | None, turn: str | None, message: dict, i: int
    ) -> tuple[int, int]:
        """Find a turn the template rewrote in the full render: after its header, up to the longest tail of it."""
        header, marker = self.markers.generation_header, self.markers.end_of_turn
        if start is None and header:
            found = full.find(header, cursor)
            if found >= 0:
                start = found + len(header)
        lo = start if start is not None else cursor
        # The turn ends before the next assistant header: a tail found past it would belong to a later turn.
        hi = full.find(header, lo) if header else -1
        hi = hi if hi >= 0 else len(full)
        anchor = (
            turn[: self._cut_after_end_of_turn(turn, 0, len(turn))] if turn else message["content"].rstrip()
        )
        end = lo
        if anchor:
            length, pos = _longest_tail_in(full, anchor, lo, hi)
            if length == 0:
                raise _malformed(f"assistant message {i} cannot be found in the rendered conversation")
            end = pos + length
            start = pos if start is None else start
        if marker and not anchor.endswith(marker):
            found = full.find(marker, end, hi)
            end = found + len(marker) if found >= 0 else end
        if start is None or (end <= start and anchor):
            raise _malformed(f"assistant message {i} cannot be found in the rendered conversation")
        return start, end


# ---------------------------------------------------------------------------------------------------------------
# Parallel tokenization


_worker_encoder: _RowEncoder | None = None


def _init_worker(tokenizer, max_length: int, too_long: str) -> None:
    global _worker_encoder
    _worker_encoder = _RowEncoder(tokenizer, max_length, too_long)


def _encode_chunk(chunk: list[tuple[int, Any]]) -> list[tuple]:
    assert _worker_encoder is not None, "_init_worker runs first in every tokenizer process"
    return [_worker_encoder.encode(index, row) for index, row in chunk]


def _chunks(rows: Iterable[Any], size: int) -> Iterator[list[tuple[int, Any]]]:
    chunk: list[tuple[int, Any]] = []
    for index, row in enumerate(rows):
        chunk.append((index, row))
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_all(
    rows: Iterator[Any],
    total: int | None,
    tokenizer,
    max_length: int,
    too_long: str,
    num_proc: int,
    progress: bool,
) -> Iterator[tuple]:
    """Row results in file order, from this process or ``num_proc`` spawned ones (the same code either way)."""
    bar = tqdm(total=total, unit="rows", desc="tokenizing", disable=not progress, dynamic_ncols=True)
    with bar:
        if num_proc == 1:
            _init_worker(tokenizer, max_length, too_long)
            for chunk in _chunks(rows, CHUNK_ROWS):
                results = _encode_chunk(chunk)
                bar.update(len(results))
                yield from results
            return
        context = multiprocessing.get_context("spawn")
        with context.Pool(
            num_proc, initializer=_init_worker, initargs=(tokenizer, max_length, too_long)
        ) as pool:
            for results in pool.imap(_encode_chunk, _chunks(rows, CHUNK_ROWS)):
                bar.update(len(results))
                yield from results


def _tokenize(data_path: Path, tokenizer, max_length: int, too_long: str, num_proc: int, progress: bool):
    rows, total = _open_rows(data_path)
    sample_ids: list[str] = []
    id_arrays: list[np.ndarray] = []
    mask_arrays: list[np.ndarray] = []
    counts = dict.fromkeys(("rows", "truncated", *_SKIP_KINDS), 0)
    examples: list[dict] = []
    per_kind: dict[str, int] = {}
    for index, sample_id, status, reason, ids, mask in _encode_all(
        rows, total, tokenizer, max_length, too_long, num_proc, progress
    ):
        counts["rows"] += 1
        if status != "kept":
            counts[status] += 1
            per_kind[status] = per_kind.get(status, 0) + 1
            if per_kind[status] <= EXAMPLES_PER_KIND:
                examples.append({"row": index, "id": sample_id, "kind": status, "reason": reason})
        if ids is not None:
            sample_ids.append(sample_id)
            id_arrays.append(ids)
            mask_arrays.append(mask)
    lengths = np.array([len(a) for a in id_arrays], dtype=np.int64)
    report = DataReport(
        rows=counts["rows"],
        kept=len(sample_ids),
        truncated=counts["truncated"],
        skipped_empty=counts["empty"],
        skipped_malformed=counts["malformed"],
        skipped_too_long=counts["too_long"],
        tokens=int(lengths.sum()),
        max_length=max_length,
        examples=examples,
    )
    if not sample_ids:
        problems = "; ".join(f"row {e['row']} ({e['kind']}): {e['reason']}" for e in examples[:5])
        raise HsextractError(
            f"no usable samples in {data_path}: {report.summary()}."
            + (f" First problems: {problems}." if problems else "")
            + " Fix the rows or give another data file."
        )
    samples = TokenizedSamples(
        sample_ids=sample_ids,
        input_ids=np.concatenate(id_arrays),
        loss_mask=np.concatenate(mask_arrays),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
    )
    return samples, report


def load_samples(
    data_path: str | Path,
    tokenizer,
    *,
    max_length: int,
    too_long: str = "truncate",
    num_proc: int = 1,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> tuple[TokenizedSamples, DataReport]:
    """Read, tokenize and mask every row of ``data_path``; bad rows are skipped and counted in the report.

    ``too_long`` says what happens to a row over ``max_length`` tokens: ``"truncate"`` keeps its first
    ``max_length`` tokens, ``"skip"`` drops it. With ``cache_dir``, an earlier result for the same data bytes,
    tokenizer, template and length policy is loaded instead of tokenizing again.
    """
    if too_long not in TOO_LONG_POLICIES:
        raise HsextractError(f"too_long must be one of {', '.join(TOO_LONG_POLICIES)}, got {too_long!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise HsextractError(f"max_length must be a positive integer, got {max_length!r}")
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise HsextractError(f"num_proc must be a positive integer, got {num_proc!r}")
    data_path = Path(data_path)
    _data_format(data_path)

    cache_path = None
    if cache_dir is not None:
        cache_path = cache_file(cache_dir, data_path, tokenizer, max_length=max_length, too_long=too_long)
        if cache_path.exists():
            try:
                samples, metadata = TokenizedSamples._load(cache_path)
                report = DataReport.from_json(json.loads(metadata["data_report"]))
            except Exception as e:  # a damaged cache file costs a re-tokenization, never the run
                logger.warning("ignoring unreadable token cache %s (%s); tokenizing again", cache_path, e)
            else:
                logger.info("loaded %d tokenized samples from cache %s", len(samples), cache_path)
                return samples, report

    samples, report = _tokenize(data_path, tokenizer, max_length, too_long, num_proc, progress)
    if cache_path is not None:
        samples._save(cache_path, {"data_report": json.dumps(report.to_json())})
    return samples, report
