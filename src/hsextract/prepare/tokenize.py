"""Data sources -> tokenized samples with a loss mask: the first stage of the pipeline.

The data is one source or a mix of several (sources.py: files, globs, dataset directories, Hub ids, S3 prefixes,
with limits, fractions, names and column mappings). A row is one of four kinds, tried in this order:

- pre-tokenized: ``input_ids`` (list of ints) with an optional ``loss_mask`` (0/1, same length, default all ones);
  it is kept exactly as given, since it is what the user already tokenized;
- chat: ``messages`` (``{role, content, tool_calls?, reasoning_content?...}``) with optional row-level ``tools``;
- ShareGPT: ``conversations`` (``{from, value}``), mapped onto chat roles, with an optional row-level ``system``;
- plain ``text`` (code, documents): tokenized without a template, every token supervised unless a mask is given.

Bad rows never crash a run and are never dropped silently: each is counted per source in a ``DataReport``
(report.py) with a few examples. A source where no row survives is an error naming it. With ``dedupe``, a row whose
token ids equal an earlier row's (in any source) is dropped and counted.

How one row becomes ids and a loss mask is chat.py's job.

Rows are streamed from the sources into ``num_proc`` spawned processes (spawn, not fork: the caller may hold
threads or CUDA), in chunks in source order, so the result does not depend on ``num_proc``; the results are
gathered into a few large arrays, not an object per row. With ``cache_dir`` the result and its report are stored in
one safetensors file whose name hashes the sources' identities and options, the tokenizer, the chat template, the
length policy, ``dedupe`` and ``FORMAT_VERSION`` (bump it whenever the encoding changes); a later call with the
same inputs loads that file instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from hsextract.config import TOO_LONG_POLICIES
from hsextract.errors import HsextractError, load_or_explain
from hsextract.prepare.chat import RowEncoder
from hsextract.prepare.report import DataReport, ReportBuilder
from hsextract.prepare.sources import Mix, resolve_sources
from hsextract.storage.fileio import atomic_write

log = logging.getLogger(__name__)


FORMAT_VERSION = 1


CHUNK_ROWS = 64

"""Rows per task sent to a tokenizer process: large enough to amortise pickling, small for a smooth progress bar."""


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
        from safetensors.numpy import save

        # Sample ids go in a byte tensor, not the header: safetensors caps the header at 100 MB.
        ids_json = np.frombuffer(json.dumps(self.sample_ids).encode(), dtype=np.uint8)
        tensors = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "offsets": self.offsets,
            "sample_ids_json": ids_json.copy(),
        }
        meta = {"format": "hsextract.tokenized_samples", **metadata}
        atomic_write(path, lambda f: f.write(save(tensors, metadata=meta)))
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


def cache_file(cache_dir: Path, mix: Mix, tokenizer, *, max_length: int, too_long: str, dedupe=False) -> Path:
    """Where ``load_samples`` keeps (or finds) the tokenized samples for these inputs."""
    parts = {
        "format_version": FORMAT_VERSION,
        **mix.fingerprint(),
        **tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "too_long": too_long,
        **({"dedupe": True} if dedupe else {}),
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"tokens-{key}.safetensors"


_worker_encoder: RowEncoder | None = None


def _init_worker(tokenizer, max_length: int, too_long: str) -> None:
    global _worker_encoder
    _worker_encoder = RowEncoder(tokenizer, max_length, too_long)


def _encode_chunk(chunk: list[tuple[int, int, Any]]) -> list[tuple]:
    assert _worker_encoder is not None, "_init_worker runs first in every tokenizer process"
    return [(source, *_worker_encoder.encode(position, row)) for source, position, row in chunk]


def _chunks(rows: Iterable[Any], size: int) -> Iterator[list]:
    chunk: list = []
    for item in rows:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_all(
    rows: Iterator[tuple[int, int, Any]],
    total: int | None,
    tokenizer,
    max_length: int,
    too_long: str,
    num_proc: int,
    progress: bool,
) -> Iterator[tuple]:
    """Row results in source order, from this process or ``num_proc`` spawned ones (the same code either way)."""
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


class _Gathered:
    """Kept samples gathered into a few large arrays: a block of ``BLOCK`` samples becomes one array."""

    BLOCK = 4096

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.pending_ids: list[np.ndarray] = []
        self.pending_masks: list[np.ndarray] = []
        self.lengths: list[int] = []

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.pending_ids.append(ids)
        self.pending_masks.append(mask)
        self.lengths.append(len(ids))
        if len(self.pending_ids) >= self.BLOCK:
            self._flush()

    def _flush(self) -> None:
        if self.pending_ids:
            self.ids.append(np.concatenate(self.pending_ids))
            self.masks.append(np.concatenate(self.pending_masks))
            self.pending_ids, self.pending_masks = [], []

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The concatenated ids, mask and offsets. Each block is freed as soon as it is copied, so the peak is one
        copy of the arrays plus a block, not two copies (as ``np.concatenate`` of the list would hold)."""
        self._flush()
        lengths = np.asarray(self.lengths, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return (
            _drain(self.ids, int(offsets[-1]), np.int32),
            _drain(self.masks, int(offsets[-1]), np.uint8),
            offsets,
        )


def _drain(blocks: list[np.ndarray], total: int, dtype) -> np.ndarray:
    out = np.empty(total, dtype=dtype)
    at = 0
    blocks.reverse()
    while blocks:
        block = blocks.pop()
        out[at : at + len(block)] = block
        at += len(block)
    return out


def _tokenize(
    mix: Mix, tokenizer, max_length: int, too_long: str, num_proc: int, progress: bool, dedupe: bool
):
    builder = ReportBuilder(mix.describe(), max_length, labelled=mix.prefixed)
    sample_ids: list[str] = []
    gathered = _Gathered()
    seen: set[bytes] = set()
    total = None if any(s.spec.fraction or s.spec.sample for s in mix.sources) else _known_total(mix)
    for source, position, row_id, status, reason, ids, mask in _encode_all(
        mix.rows(), total, tokenizer, max_length, too_long, num_proc, progress
    ):
        sample_id = mix.sample_id(source, row_id)
        if ids is not None and dedupe:
            digest = hashlib.blake2b(ids.tobytes(), digest_size=16).digest()
            if digest in seen:
                status, reason, ids = "duplicate", "its token ids equal an earlier row's", None
            seen.add(digest)
        builder.add(source, position, sample_id, status, reason, 0 if ids is None else len(ids))
        if ids is not None:
            sample_ids.append(sample_id)
            gathered.add(ids, mask)
    builder.check_usable([s.label for s in mix.sources])
    input_ids, loss_mask, offsets = gathered.arrays()
    samples = TokenizedSamples(
        sample_ids=sample_ids, input_ids=input_ids, loss_mask=loss_mask, offsets=offsets
    )
    return samples, builder.report()


def _known_total(mix: Mix) -> int | None:
    """Rows to tokenize when every source knows its count without a pass (for the progress bar)."""
    total = 0
    for s in mix.sources:
        if s.dataset is None:
            return None
        total += len(s.dataset) if s.spec.limit is None else min(s.spec.limit, len(s.dataset))
    return total


AUTO_PARALLEL_MIN_BYTES = 16_000_000

"""Data below this size is tokenized in the calling process. A pool starts ~6.5 s later (each spawned process
unpickles the tokenizer, importing transformers) and one process tokenizes ~1.3 MB of JSONL chat rows a second:
on 16 cores pools of 4-16 won from ~10 MB (~1,600 rows of ~1k tokens); on 2 cores they never did, up to 36 MB
(docs/PERFORMANCE.md, scripts/bench_tokenize.py)."""


AUTO_MAX_PROC = 16

"""Past 8-16 processes the parent, which reads the rows and gathers the results, is the bottleneck."""


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


def load_samples(
    data,
    tokenizer,
    *,
    max_length: int,
    too_long: str = "truncate",
    num_proc: int | None = 1,
    cache_dir: Path | None = None,
    progress: bool = True,
    dedupe: bool = False,
    seed: int = 0,
    s3_endpoint_url: str | None = None,
) -> tuple[TokenizedSamples, DataReport]:
    """Read, tokenize and mask every row of ``data``; bad rows are skipped and counted in the report.

    ``data`` is a ``Mix`` (sources.resolve_sources), or what ``--data`` takes: one source spec or a list of them,
    resolved here with ``seed``, ``cache_dir`` and ``s3_endpoint_url``. ``too_long`` says what happens to a row
    over ``max_length`` tokens: ``"truncate"`` keeps its first ``max_length`` tokens, ``"skip"`` drops it. With
    ``cache_dir``, an earlier result for the same sources, tokenizer, template and length policy is loaded instead
    of tokenizing again. ``num_proc=None`` chooses the process count from the cores and the data's size
    (``auto_num_proc``).
    """
    if too_long not in TOO_LONG_POLICIES:
        raise HsextractError(f"too_long must be one of {', '.join(TOO_LONG_POLICIES)}, got {too_long!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise HsextractError(f"max_length must be a positive integer, got {max_length!r}")
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
        raise HsextractError(f"num_proc must be a positive integer, got {num_proc!r}")
    mix = data
    if not isinstance(mix, Mix):
        mix = resolve_sources(data, seed=seed, cache_dir=cache_dir, s3_endpoint_url=s3_endpoint_url)
    if num_proc is None:
        num_proc = auto_num_proc(mix)
        log.info("tokenizing in %d process(es), chosen from the cores and the data's size", num_proc)

    cache_path = None
    if cache_dir is not None:
        cache_path = cache_file(
            cache_dir, mix, tokenizer, max_length=max_length, too_long=too_long, dedupe=dedupe
        )
        if cache_path.exists():
            try:
                samples, metadata = TokenizedSamples._load(cache_path)
                report = DataReport.from_json(json.loads(metadata["data_report"]))
            except Exception as e:  # a damaged cache file costs a re-tokenization, never the run
                log.warning("ignoring unreadable token cache %s (%s); tokenizing again", cache_path, e)
            else:
                log.info("loaded %d tokenized samples from cache %s", len(samples), cache_path)
                return samples, report

    samples, report = _tokenize(mix, tokenizer, max_length, too_long, num_proc, progress, dedupe)
    if cache_path is not None:
        samples._save(cache_path, {"data_report": json.dumps(report.to_json())})
    return samples, report


def load_tokenizer(model: str):
    """The model's tokenizer, with a pad token (any id works: padding is on the right and masked out)."""
    from transformers import AutoTokenizer

    tok = load_or_explain(model, "load its tokenizer", lambda: AutoTokenizer.from_pretrained(model))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    return tok


def unique_sample_ids(samples: TokenizedSamples) -> tuple[TokenizedSamples, int]:
    """Rows sharing an id are all kept; repeats get ``#2``, ``#3``... so the reader can look each one up.
    Returns the samples and how many ids were renamed."""
    seen: dict[str, int] = {}
    ids, renamed = [], 0
    for sid in samples.sample_ids:
        n = seen.get(sid, 0) + 1
        seen[sid] = n
        if n > 1:
            renamed += 1
            sid = f"{sid}#{n}"
            while sid in seen:
                sid += "'"
            seen[sid] = 1
        ids.append(sid)
    if not renamed:
        return samples, 0
    fixed = TokenizedSamples(
        sample_ids=ids, input_ids=samples.input_ids, loss_mask=samples.loss_mask, offsets=samples.offsets
    )
    return fixed, renamed
