"""Data sources -> tokenized samples with a loss mask: the first stage of the pipeline.

Bad rows never crash a run and are never dropped silently: each is counted per source in a ``DataReport``. Rows
stream in source-order chunks into ``num_proc`` spawned processes (the caller may hold threads or CUDA), so the
result does not depend on ``num_proc``; tokens go straight into the token file. With ``cache_dir`` that file is
kept under a hash of every input of the encoding (bump ``FORMAT_VERSION`` when it changes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import pickle
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from hsextract.errors import HsextractError, load_or_explain
from hsextract.prepare.chat import AUTO, DEFAULT_CHAT, ChatOptions, RowEncoder
from hsextract.prepare.pool import start_pool
from hsextract.prepare.report import TOO_LONG_POLICIES, DataReport, ReportBuilder
from hsextract.prepare.rows import JsonLine
from hsextract.prepare.sources import Mix, auto_num_proc, finish_row, resolve_sources
from hsextract.prepare.tiktoken_bpe import spec_of
from hsextract.prepare.tokenfile import TokenFileWriter, TokenizedSamples

log = logging.getLogger(__name__)


FORMAT_VERSION = 3

"""2: a turn's mask starts after what the generation prompt writes; dropped reasoning counted per turn. 3: a
reply's ids as the server sent them, cut replies end where their text ends, ``--rows per-turn``."""


CHUNK_ROWS = 256

"""Rows per task sent to a tokenizer process: the pool's cost per task (two pipe messages, a wake-up of the parent)
becomes a few microseconds a row; a task is still under a second of one process's work."""


CHUNKS_IN_FLIGHT = 3

"""Chunks queued per tokenizer process: enough to keep each busy, few enough that rows never pile up."""


def tokenizer_fingerprint(tokenizer) -> dict:
    """Hashes of what decides the token ids: the tokenizer (with its special tokens) and the chat template. A
    ``RecordedTokenizer`` (tokenizer_record.py) answers from its record, without loading the tokenizer."""
    if hasattr(tokenizer, "recorded_fingerprint"):
        return tokenizer.recorded_fingerprint()
    # Templates render bos/eos by name, so the special-token map belongs to the tokenizer's identity.
    specials = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
    template = tokenizer.chat_template
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    # Serializing a large vocabulary takes seconds and preparing asks twice (cache key, plan): kept on the
    # tokenizer, keyed by what could change on it after loading.
    key = (len(tokenizer), specials)
    cached = getattr(tokenizer, "_hsextract_tokenizer_hash", None)
    if cached is None or cached[0] != key:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
        cached = (key, hashlib.sha256((text + specials).encode()).hexdigest())
        try:
            tokenizer._hsextract_tokenizer_hash = cached
        except AttributeError:
            pass
    return {
        "tokenizer_hash": cached[1],
        "chat_template_hash": hashlib.sha256(template.encode()).hexdigest(),
    }


def cache_file(
    cache_dir: Path,
    mix: Mix,
    tokenizer,
    *,
    max_length: int,
    too_long: str,
    dedupe=False,
    chat: ChatOptions = DEFAULT_CHAT,
) -> Path:
    """Where ``load_samples`` keeps (or finds) the tokenized samples for these inputs."""
    parts = {
        "format_version": FORMAT_VERSION,
        **mix.fingerprint(),
        **tokenizer_fingerprint(tokenizer),
        **chat.fingerprint(),
        "max_length": max_length,
        "too_long": too_long,
        **({"dedupe": True} if dedupe else {}),
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"tokens-{key}.safetensors"


_worker_encoder: RowEncoder | None = None


_worker_columns: tuple = ()


def _init_worker(
    tokenizer, max_length: int, too_long: str, columns: tuple = (), tiktoken=AUTO, chat=DEFAULT_CHAT
) -> None:
    """``tokenizer`` (and ``tiktoken``, its checked spec) come pickled into a pool's processes (``bytes``): pickled
    once for all of them. ``columns``: each source's column mapping, for the ``JsonLine`` rows parsed here."""
    global _worker_encoder, _worker_columns
    if isinstance(tokenizer, bytes):
        tokenizer, tiktoken = pickle.loads(tokenizer)
    _worker_encoder = RowEncoder(tokenizer, max_length, too_long, tiktoken=tiktoken, chat=chat)
    _worker_columns = columns


def _encode_chunk(chunk: list[tuple[int, int, Any]]) -> tuple[list[tuple], np.ndarray, np.ndarray]:
    """Per sample ``(source, position, row_id, status, reason, tokens, digest, notes)`` (notes: ``RowEncoder.encode_rows``'s
    last three), then the kept samples' ids and masks concatenated: two arrays per chunk travel back, not two per row."""
    assert _worker_encoder is not None, "_init_worker runs first in every tokenizer process"
    rows, ids, masks = [], [], []
    for source, position, row in chunk:
        if isinstance(row, JsonLine):
            row = finish_row(row, _worker_columns[source])
        for sample in _worker_encoder.encode_rows(position, row):
            _, row_id, status, reason, row_ids, row_mask, *notes = sample
            if row_ids is None:
                rows.append((source, position, row_id, status, reason, 0, b"", tuple(notes)))
                continue
            row_ids = np.ascontiguousarray(row_ids, dtype=np.int32)
            digest = hashlib.blake2b(row_ids.tobytes(), digest_size=16).digest()
            rows.append((source, position, row_id, status, reason, len(row_ids), digest, tuple(notes)))
            ids.append(row_ids)
            masks.append(np.asarray(row_mask, dtype=np.uint8))
    if not ids:
        return rows, np.zeros(0, np.int32), np.zeros(0, np.uint8)
    return rows, np.concatenate(ids), np.concatenate(masks)


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
    columns: tuple = (),
    tiktoken=AUTO,
    chat: ChatOptions = DEFAULT_CHAT,
) -> Iterator[tuple[list[tuple], np.ndarray, np.ndarray]]:
    """Chunk results in source order, from this process or ``num_proc`` spawned ones (the same code either way),
    with at most ``CHUNKS_IN_FLIGHT`` chunks per process read ahead. ``columns``: per source, for ``JsonLine``s.
    ``tiktoken``: None keeps the tokenizer's own backend (``RowEncoder``)."""
    bar = tqdm(total=total, unit="rows", desc="tokenizing", disable=not progress, dynamic_ncols=True)
    with bar:
        if num_proc == 1:
            _init_worker(tokenizer, max_length, too_long, columns, tiktoken, chat)
            for chunk in _chunks(rows, CHUNK_ROWS):
                result = _encode_chunk(chunk)
                bar.update(len(result[0]))
                yield result
            return
        context = multiprocessing.get_context("spawn")
        # Pickled here once: a pool pickles its initargs for each process it starts, one after the other, and a
        # large vocabulary takes a second or more each time.
        # The tiktoken check encodes the whole vocabulary both ways: once, here.
        spec = spec_of(tokenizer) if tiktoken == AUTO else tiktoken
        pickled = pickle.dumps((tokenizer, spec), protocol=pickle.HIGHEST_PROTOCOL)
        args = (pickled, max_length, too_long, columns, AUTO, chat)
        pool = start_pool(context, num_proc, _init_worker, args)
        with pool:
            pending: deque = deque()
            for chunk in _chunks(rows, CHUNK_ROWS):
                pending.append(pool.apply_async(_encode_chunk, (chunk,)))
                if len(pending) >= num_proc * CHUNKS_IN_FLIGHT:
                    result = pending.popleft().get()
                    bar.update(len(result[0]))
                    yield result
            while pending:
                result = pending.popleft().get()
                bar.update(len(result[0]))
                yield result


def _tokenize(
    mix: Mix,
    tokenizer,
    max_length: int,
    too_long: str,
    num_proc: int,
    progress: bool,
    dedupe: bool,
    path: Path,
    rows_of: Iterator[tuple[int, int, Any]] | None = None,
    tiktoken=AUTO,
    chat: ChatOptions = DEFAULT_CHAT,
) -> tuple[TokenizedSamples, DataReport]:
    """Tokenize every row (or those of ``rows_of``) into the token file at ``path``, streaming; returns its
    samples (mapped) and report."""
    builder = ReportBuilder(mix.describe(), max_length, labelled=mix.prefixed)
    seen: set[bytes] = set()
    total = None if any(s.spec.fraction or s.spec.sample for s in mix.sources) else _known_total(mix)
    if rows_of is not None:
        total = None
    # closing: a stop signal (or any error) while the rows stream ends the pool at once, not when the traceback
    # holding this frame is freed
    with (
        TokenFileWriter(path) as writer,
        contextlib.closing(
            _encode_all(
                mix.rows(parse=False) if rows_of is None else rows_of,
                total,
                tokenizer,
                max_length,
                too_long,
                num_proc,
                progress,
                tuple(s.spec.columns for s in mix.sources),
                tiktoken,
                chat,
            )
        ) as chunks,
    ):
        for rows, ids, mask in chunks:
            kept_ids, lengths, cut, at = [], [], [], 0
            for source, position, row_id, status, reason, tokens, digest, notes in rows:
                sample_id = mix.sample_id(source, row_id)
                at += tokens
                if tokens and dedupe:
                    if digest in seen:
                        status, reason = "duplicate", "its token ids equal an earlier row's"
                        cut.append((at - tokens, tokens))
                        builder.add(source, position, sample_id, status, reason, 0)
                        continue
                    seen.add(digest)
                builder.add(source, position, sample_id, status, reason, tokens, *notes)
                if tokens:
                    kept_ids.append(sample_id)
                    lengths.append(tokens)
            if cut:  # duplicates' tokens leave the chunk's arrays
                keep = np.ones(len(ids), dtype=bool)
                for start, n in cut:
                    keep[start : start + n] = False
                ids, mask = ids[keep], mask[keep]
            writer.add_block(kept_ids, lengths, ids, mask)
        builder.check_usable([s.label for s in mix.sources], cut=mix.limit is not None)
        report = builder.report()
        samples = writer.finish({"data_report": json.dumps(report.to_json())})
    return samples, report


def _known_total(mix: Mix) -> int | None:
    """Rows to tokenize when every source knows its count without a pass (for the progress bar)."""
    total = 0
    for s in mix.sources:
        if s.dataset is None:
            return None
        total += len(s.dataset) if s.spec.limit is None else min(s.spec.limit, len(s.dataset))
    return total if mix.limit is None else min(total, mix.limit)


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
    chat: ChatOptions = DEFAULT_CHAT,
) -> tuple[TokenizedSamples, DataReport]:
    """Read, tokenize and mask every row of ``data``; bad rows are skipped and counted in the report.

    ``data`` is a ``Mix`` (sources.resolve_sources), or what ``--data`` takes: one source spec or a list of them,
    resolved here with ``seed``, ``cache_dir`` and ``s3_endpoint_url``. ``too_long`` says what happens to a row
    over ``max_length`` tokens: ``"truncate"`` keeps its first ``max_length`` tokens, ``"skip"`` drops it. With
    ``cache_dir``, an earlier result for the same sources, tokenizer, template and length policy is loaded instead
    of tokenizing again. ``num_proc=None`` chooses the process count from the cores and the data's size
    (``auto_num_proc``). ``chat``: the chat template and its arguments, as the server renders.
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

    args = (max_length, too_long, num_proc, progress, dedupe)
    if cache_dir is None:
        # The token file is still the one place the tokens go; unlinked at once, it lives as long as its mapping.
        import tempfile

        with tempfile.TemporaryDirectory(prefix="hsextract-tokens-") as tmp:
            path = Path(tmp) / "tokens.safetensors"
            tokenizer, tiktoken = _loaded(tokenizer)
            samples, report = _tokenize(mix, tokenizer, *args, path, tiktoken=tiktoken, chat=chat)
        return replace(samples, file=None), report
    cache_path = cache_file(
        cache_dir, mix, tokenizer, max_length=max_length, too_long=too_long, dedupe=dedupe, chat=chat
    )
    if cache_path.exists():
        try:
            samples, metadata = TokenizedSamples._load(cache_path)
            report = DataReport.from_json(json.loads(metadata["data_report"]))
        except HsextractError as e:  # a cache file that does not prove itself is made again from its rows
            log.warning("%s: tokenizing its rows again", e)
        except Exception as e:  # a damaged cache file costs a re-tokenization, never the run
            log.warning("ignoring unreadable token cache %s (%s); tokenizing again", cache_path, e)
        else:
            log.info("loaded %d tokenized samples from cache %s", len(samples), cache_path)
            return samples, report
    tokenizer, tiktoken = _loaded(tokenizer)
    return _tokenize(mix, tokenizer, *args, cache_path, tiktoken=tiktoken, chat=chat)


def _loaded(tokenizer) -> tuple:
    """The tokenizer itself, for tokenizing (a ``RecordedTokenizer`` loads it now), and its checked tiktoken spec
    where a ``RecordedTokenizer`` keeps one (else ``AUTO``: checked when tokenizing)."""
    if not hasattr(tokenizer, "recorded_fingerprint"):
        return tokenizer, AUTO
    return tokenizer.load(), tokenizer.tiktoken_spec()


SAMPLE_ROWS = 2000

"""Rows the dry run tokenizes for its estimate when the token cache does not hold the data yet."""


@dataclass(frozen=True)
class SampledData:
    """Tokenized samples standing for the data: all of it (from the token cache) or its first rows."""

    samples: TokenizedSamples
    report: DataReport
    rows_sampled: int
    """Rows tokenized; equal to ``rows_total`` when the samples are the whole data."""
    rows_total: int
    basis: str
    """``token cache``, ``all rows`` (tokenized now: fewer than a sample's) or ``sample``."""

    @property
    def scale(self) -> float:
        """Rows of the data per row tokenized."""
        return self.rows_total / max(1, self.rows_sampled)


def load_sample(
    mix: Mix,
    tokenizer,
    *,
    max_length: int,
    too_long: str = "truncate",
    cache_dir: Path | None = None,
    dedupe: bool = False,
    rows: int | None = None,
    chat: ChatOptions = DEFAULT_CHAT,
) -> SampledData:
    """The whole data from the token cache when it is there, else about ``rows`` (``SAMPLE_ROWS``) rows tokenized: from each source
    its first rows, in proportion to its row count (one pass over the lines, no parsing), so that an estimate
    scaled by ``scale`` stands for the mix."""
    if cache_dir is not None:
        path = cache_file(
            cache_dir, mix, tokenizer, max_length=max_length, too_long=too_long, dedupe=dedupe, chat=chat
        )
        if path.exists():
            samples, report = load_samples(
                mix,
                tokenizer,
                max_length=max_length,
                too_long=too_long,
                cache_dir=cache_dir,
                dedupe=dedupe,
                chat=chat,
            )
            return SampledData(samples, report, report.rows, report.rows, "token cache")
    rows = SAMPLE_ROWS if rows is None else rows
    counts = mix.within_limit([_selected_rows(s, mix.seed) for s in mix.sources])
    total = sum(counts)
    take = [min(n, max(1, round(rows * n / max(1, total)))) for n in counts]  # n: cut by --max-samples too

    def first_rows() -> Iterator[tuple[int, int, Any]]:
        for i, (source, k) in enumerate(zip(mix.sources, take, strict=True)):
            for position, row in islice(source.rows(mix.seed), k):
                yield i, position, row

    import tempfile

    with tempfile.TemporaryDirectory(prefix="hsextract-tokens-") as tmp:
        path = Path(tmp) / "tokens.safetensors"
        samples, report = _tokenize(
            # The tokenizer's own backend: tiktoken's check of the vocabulary costs more than a sample's rows.
            mix,
            tokenizer,
            max_length,
            too_long,
            1,
            False,
            dedupe,
            path,
            rows_of=first_rows(),
            tiktoken=None,
            chat=chat,
        )
    basis = "all rows" if report.rows >= total else "sample"
    return SampledData(replace(samples, file=None), report, report.rows, total, basis)


def _selected_rows(source, seed: int) -> int:
    chosen = source.selected(seed)
    if chosen is not None:
        return len(chosen)
    available = source.available()
    return available if source.spec.limit is None else min(source.spec.limit, available)


def load_tokenizer(model: str, trust_remote_code: bool = False, flag: str = "--model"):
    """The tokenizer in ``model`` (given as ``flag``), with a pad token (any id works: padding is on the right and
    masked out)."""
    from transformers import AutoTokenizer

    tok = load_or_explain(
        model,
        "load its tokenizer",
        lambda: AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code),
        flag,
    )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    return tok


def unique_sample_ids(samples: TokenizedSamples) -> tuple[TokenizedSamples, int]:
    """Rows sharing an id are all kept; repeats get ``#2``, ``#3``... so the reader can look each one up.
    Returns the samples and how many ids were renamed."""
    if len(set(samples.sample_ids)) == len(samples.sample_ids):
        return samples, 0  # the usual case, in one C-level pass
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
