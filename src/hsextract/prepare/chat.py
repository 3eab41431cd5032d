"""One row -> token ids and a loss mask, for any chat template; ``RowEncoder.encode`` never raises (a row it cannot
encode comes back with its skip kind and reason).

Nothing about a template is hard-coded: the conversation is rendered once with the server's template and arguments
and tokenized with offsets; assistant turns are found by the role header they open with (probed), and a turn that
cannot be located makes the row malformed, never mis-masked. docs/DATA.md has the row forms and the mask.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsextract.prepare.chat_markers import ChatMarkers
from hsextract.prepare.fast_tokenizer import OwnBackend
from hsextract.prepare.messages import (  # noqa: F401 -- the row readers, re-exported for the encoder's callers
    CHAT_ROLES,
    SHAREGPT_ROLES,
    UnreadableRow,
    _chat_messages,
    _malformed,
    _RowSkipped,
    _sharegpt_messages,
    _tools,
    _unrendered,
    no_row_field,
)
from hsextract.prepare.served import ROWS, served_row, take_served_ids, trim_cut_turns, turn_rows
from hsextract.prepare.template_error import template_failure
from hsextract.prepare.tiktoken_bpe import TiktokenEncoder, TokenizerDisagrees, spec_of

SKIP_KINDS = ("malformed", "empty", "too_long")


AUTO = "auto"


PREFIX_MARGIN_TOKENS = 64

"""Tokens beyond ``max_length`` that a truncated row's prefix surely holds: a cut changes only tokens near it."""


FAR_TOO_LONG = 4


@dataclass(frozen=True)
class ChatOptions:
    """How conversations are rendered, as the server renders them: its template (None: the tokenizer's own) and
    the arguments every rendering gets (``chat_template_kwargs``, e.g. ``enable_thinking``)."""

    template: str | None = None
    kwargs_json: str = "{}"
    """The arguments as canonical JSON (sorted keys): hashable, and what the plan records."""
    rows: str = ROWS[0]
    """One row per conversation, or one per assistant turn (``served.ROWS``)."""
    name: str | None = field(default=None, compare=False)
    """The template as messages name it, e.g. ``the chat template t.jinja`` (None: the tokenizer's own)."""

    @classmethod
    def of(
        cls,
        template: str | None = None,
        kwargs: dict | None = None,
        rows: str = ROWS[0],
        name: str | None = None,
    ) -> ChatOptions:
        return cls(template, json.dumps(kwargs or {}, sort_keys=True), rows, name)

    @property
    def kwargs(self) -> dict:
        return json.loads(self.kwargs_json)

    def fingerprint(self) -> dict:
        """What these options add to a plan's or a token cache's identity: nothing when they are the defaults,
        so that plans made without them hash as before."""
        out = {}
        if self.template is not None:
            out["chat_template_hash"] = hashlib.sha256(self.template.encode()).hexdigest()
            out["chat_template_given"] = True
        if self.kwargs:
            out["chat_template_kwargs"] = self.kwargs
        if self.rows != ROWS[0]:
            out["rows"] = self.rows
        return out


DEFAULT_CHAT = ChatOptions()


def marked_text(tokenizer, ids, mask, limit: int = 2000) -> str:
    """The tokens decoded, each run of loss-masked (assistant) tokens between ``«`` and ``»``: what the dry run
    prints so that a user sees which text the drafter learns from."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    parts, start = [], 0
    for end in [*(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(ids)]:
        text = tokenizer.decode(ids[start:end].tolist())
        parts.append(f"«{text}»" if mask[start] else text)
        start = end
    text = "".join(parts)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


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
    """1 for tokens of non-empty character range that overlaps one of the sorted, disjoint ``spans``."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans or not len(offsets):
        return mask
    tok_starts, tok_ends = offsets[:, 0], offsets[:, 1]  # sorted: tokens follow each other
    for start, end in spans:
        first = np.searchsorted(tok_ends, start, side="right")  # the first token ending after the span starts
        stop = np.searchsorted(tok_starts, end, side="left")  # the first token starting at or after its end
        mask[first:stop] = tok_ends[first:stop] > tok_starts[first:stop]
    return mask


class RowEncoder:
    """Turns one row into ``(ids, mask)``, or raises ``_RowSkipped``; one per tokenizer process."""

    def __init__(
        self, tokenizer, max_length: int, too_long: str, tiktoken=AUTO, chat: ChatOptions = DEFAULT_CHAT
    ):
        """``tiktoken``: a checked ``TiktokenSpec`` (a pool's parent checks once for all its processes), None to
        keep the tokenizer's own backend, or ``AUTO`` to check here. ``chat``: the template and its arguments."""
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.too_long = too_long
        self.vocab_size = len(tokenizer)
        self.chat = chat
        template = {"chat_template": chat.template} if chat.template is not None else {}
        self._template_args = {**template, **chat.kwargs}
        self.has_template = bool(chat.template or tokenizer.chat_template)
        self.markers = (
            ChatMarkers.probe(
                tokenizer,
                lambda m, g: self._render(m, None, g),
                lambda m, g: tokenizer.apply_chat_template(
                    m, tokenize=False, add_generation_prompt=g, **template
                ),
            )
            if self.has_template
            else ChatMarkers("", "")
        )
        self.unrendered: tuple[str, ...] = ()
        """What the last row encoded carried that its rendering dropped (``reasoning``, ``tools``)."""
        self.ids_from, self.prompt_differs, self._last_turn_only = "", "", False
        """The last chat row's ids came from the ``server`` or the ``text``; where the server's prompt ids differ
        from hsextract's rendering (``served.first_difference``); whether only its last turn is in the loss."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and (
            "ByteLevel(" in repr(backend.pre_tokenizer)
            or bool(getattr(backend.model, "byte_fallback", False))
        )
        """Every character is covered by tokens of at most ``longest_token`` bytes of it: no unknown-word token."""
        self.own = OwnBackend(tokenizer)
        spec = spec_of(tokenizer) if tiktoken == AUTO else tiktoken
        self.fast = TiktokenEncoder(spec, self.own) if spec is not None else None
        # A spec holds the vocabulary (entries as bytes, added tokens as text); a 248k ``get_vocab`` takes 0.5 s.
        vocab = tokenizer.get_vocab() if spec is None else itertools.chain(spec.ranks, spec.specials)
        self.longest_token = max(map(len, vocab), default=1)
        """Characters of the longest vocabulary entry (bytes, for a byte-level tokenizer's)."""

    def encode_rows(self, index: int, row: Any) -> list[tuple]:
        """``encode``'s result for each sample of the row (one per assistant turn with ``rows`` per-turn), each
        followed by ``unrendered``, ``ids_from`` and ``prompt_differs``."""
        subs = None
        if self.chat.rows == "per-turn" and isinstance(row, dict) and row.get("input_ids") is None:
            try:
                messages = _chat_messages(row["messages"]) if row.get("messages") is not None else None
                if messages is None and row.get("conversations") is not None:
                    messages = _sharegpt_messages(row["conversations"], row.get("system"))
                sample_id = str(row["id"]) if row.get("id") is not None else str(index)
                subs = turn_rows(row, messages, sample_id) if messages else None
            except _RowSkipped:
                subs = None  # ``encode`` says why
        out = []
        self._last_turn_only = bool(subs)
        for sub in subs or [row]:
            out.append((*self.encode(index, sub), self.unrendered, self.ids_from, self.prompt_differs))
        self._last_turn_only = False
        return out

    def encode(self, index: int, row: Any) -> tuple:
        """``(index, sample_id, status, reason, ids, mask)``; status is kept, truncated or a skip kind."""
        sample_id = str(index)
        if isinstance(row, dict) and row.get("id") is not None:
            sample_id = str(row["id"])
        self.unrendered, self.ids_from, self.prompt_differs = (), "", ""
        try:
            ids, mask, cut_early = self._encode(row)
            status, reason = "kept", ""
            if cut_early or len(ids) > self.max_length:
                if self.too_long == "skip":
                    raise _RowSkipped("too_long", f"{len(ids)} tokens > max_length {self.max_length}")
                status, reason = "truncated", f"{cut_early or f'{len(ids)} tokens'} cut to {self.max_length}"
                ids, mask = ids[: self.max_length], mask[: self.max_length]
                if not mask.any():
                    raise _RowSkipped("empty", f"no assistant tokens in the first {self.max_length} tokens")
        except _RowSkipped as e:
            return index, sample_id, e.kind, e.reason, None, None
        except TokenizerDisagrees:
            raise  # not the row's fault: the preparation stops
        except Exception as e:
            # One odd row must not end a run over millions; it is counted and shown instead.
            return index, sample_id, "malformed", f"unexpected {type(e).__name__}: {e}", None, None
        return index, sample_id, status, reason, ids, mask

    def _encode(self, row: Any) -> tuple[np.ndarray, np.ndarray, str]:
        """``(ids, mask, cut_early)``: ``cut_early`` is "" unless only the row's first ``max_length`` tokens were
        made (``tokenize``), and then says how long the row is."""
        if isinstance(row, UnreadableRow):
            raise _malformed(row.reason)
        if not isinstance(row, dict):
            raise _malformed(f"row is a {type(row).__name__}, not an object")
        if row.get("input_ids") is not None:
            return *self._pretokenized(row["input_ids"], row.get("loss_mask")), ""
        if row.get("messages") is not None:
            messages = _chat_messages(row["messages"])
        elif row.get("conversations") is not None:
            messages = _sharegpt_messages(row["conversations"], row.get("system"))
        elif row.get("text") is not None:
            return self._encode_text(row["text"], row.get("loss_mask"))
        else:
            raise no_row_field(row)
        tools, served = _tools(row.get("tools")), take_served_ids(messages)
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        self.ids_from = "server" if replies and replies[-1] in served else "text"
        if self.ids_from == "text":
            return self._encode_chat(messages, tools)
        ids, mask, self.prompt_differs = served_row(self, messages, tools, served, self._last_turn_only)
        return ids, mask, ""

    def _encode_text(self, text: Any, mask: Any) -> tuple[np.ndarray, np.ndarray, str]:
        """Plain text: its tokens as the tokenizer gives them, no template, no special tokens added."""
        if not isinstance(text, str):
            raise _malformed(f"'text' is a {type(text).__name__}, not a string")
        # A mask given with the text covers all its tokens: checked against their count, so tokenized whole.
        ids, _, cut_early = self.tokenize(text, whole=mask is not None)
        if not len(ids):
            raise _RowSkipped("empty", "'text' is empty")
        return *self._pretokenized(ids, mask), cut_early

    def tokenize(
        self, text: str, *, offsets: bool = False, whole: bool = False
    ) -> tuple[list, list | None, str]:
        """The tokenizer's ids of ``text`` (and each token's character span, with ``offsets``), no special tokens
        added; the third value is "" when the text was tokenized whole. When the row is cut to ``max_length``
        anyway, only the first ``max_length`` tokens are made, from a prefix (the module docstring says why they
        are the whole text's), and the third value says how long the row is; with ``skip``, a row that cannot fit
        is refused untokenized (``_RowSkipped``)."""
        n, chars = self.max_length, len(text)
        if not whole and self.too_long == "skip" and self.byte_level:
            if chars > FAR_TOO_LONG * n * self.longest_token:
                raise _RowSkipped(
                    "too_long",
                    f"{chars} characters: over max_length {n} tokens (no token spans over "
                    f"{self.longest_token} bytes)",
                )
        prefix = (n + PREFIX_MARGIN_TOKENS) * self.longest_token
        if whole or self.too_long != "truncate" or chars <= 2 * prefix:
            return *self._run(text, offsets), ""
        ids, spans = self._run(text[:prefix], offsets)
        again, again_spans = self._run(text[: 2 * prefix], offsets)
        if (
            len(ids) <= n
            or list(ids[:n]) != list(again[:n])
            or (offsets and not np.array_equal(np.asarray(spans[:n]), np.asarray(again_spans[:n])))
        ):
            return *self._run(text, offsets), ""  # a tokenizer the bound does not hold for: the whole text
        return ids[:n], spans[:n] if offsets else None, f"over {n} tokens ({chars} characters)"

    def _run(self, text: str, offsets: bool) -> tuple[list, list | None]:
        if self.fast is not None:
            return self.fast.ids_and_offsets(text, offsets)
        return self.own(text, offsets)

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
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self._template_args,
        )

    def _try_render(self, messages: list[dict], tools: list | None, generation_prompt: bool) -> str | None:
        """A partial render; some templates reject partial conversations, which only costs the fast path."""
        try:
            return self._render(messages, tools, generation_prompt)
        except Exception:
            return None

    def _encode_chat(self, messages: list[dict], tools: list | None) -> tuple[np.ndarray, np.ndarray, str]:
        if not messages:
            raise _RowSkipped("empty", "the conversation has no messages")
        said = ("content", "tool_calls", "reasoning_content")
        if not any(m["role"] == "assistant" and any(m.get(k) for k in said) for m in messages):
            raise _RowSkipped("empty", "no assistant message with content")
        if not self.has_template:
            raise _malformed(
                "the tokenizer has no chat template to render conversations with: give the one your server "
                "renders with, --chat-template FILE"
            )
        try:
            full = self._render(messages, tools)
        except Exception as e:
            raise _malformed(template_failure(e, self.chat.name)) from e
        self.unrendered = _unrendered(messages, tools, full, lambda m: self._render(m, tools))
        # A cut reply ends where its text ends (served.py); at the end of the row, so does the row.
        turns, end = trim_cut_turns(full, self._assistant_spans(messages, tools, full), messages)
        ids, spans, cut_early = self.tokenize(full if end is None else full[:end], offsets=True)
        ids = np.asarray(ids, dtype=np.int32)
        if not ids.size:
            raise _RowSkipped("empty", "the conversation renders to no tokens")
        offsets = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        mask = _mask_from_spans(offsets, turns[-1:] if self._last_turn_only else turns)
        if not mask.any() and not cut_early:  # cut early, ``encode`` refuses it as it does any cut row
            raise _RowSkipped("empty", "no assistant tokens in the rendered conversation")
        return ids, mask, cut_early

    def prompt_tokens(self, messages: list[dict], tools: list | None, with_mask: bool) -> tuple[list, Any]:
        """hsextract's own ids of a request (``messages`` and the generation prompt) and, ``with_mask``, the loss
        mask of the assistant turns in it (None without)."""
        text = self._render(messages, tools, True)
        ids, spans, _ = self.tokenize(text, offsets=with_mask, whole=True)
        if not with_mask:
            return list(ids), None
        bare = self._render(messages, tools, False)
        turns = self._assistant_spans(messages, tools, bare) if text.startswith(bare) else []
        turns, _ = trim_cut_turns(bare, turns, messages)
        return list(ids), _mask_from_spans(np.asarray(spans, dtype=np.int64).reshape(-1, 2), turns)

    def _assistant_spans(self, messages: list[dict], tools: list | None, full: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in ``full``, sorted and disjoint (see the module docstring)."""
        by_header = self._spans_by_header(messages, full)
        if by_header is not None:
            return by_header
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._try_render(messages[:i], tools, True) if i else None
            # The conversation through its last message is the full render, made once.
            through = full if i + 1 == len(messages) else self._try_render(messages[: i + 1], tools, False)
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

    def _spans_by_header(self, messages: list[dict], full: str) -> list[tuple[int, int]] | None:
        """Each assistant turn from its role header to its end-of-turn marker; None unless the headers in ``full``
        match the assistant messages one to one, each closed before the next opens."""
        header, marker = self.markers.role_header, self.markers.end_of_turn
        if not header or not marker:
            return None
        starts, at = [], full.find(header)
        while at >= 0:
            starts.append(at + len(header))
            at = full.find(header, at + len(header))
        if len(starts) != sum(m["role"] == "assistant" for m in messages):
            return None
        # What the generation prompt writes after the role header (Qwen's ``<think>\n``, or with enable_thinking
        # false the empty ``<think>\n\n</think>\n\n``) is the server's prompt, not the model's words.
        generation = self.markers.generation_header
        prompt = generation[len(header) :] if generation.startswith(header) else ""
        spans = []
        for k, start in enumerate(starts):
            start += len(prompt) if prompt and full.startswith(prompt, start) else 0
            end = full.find(marker, start)
            if end < 0 or (k + 1 < len(starts) and end + len(marker) > starts[k + 1] - len(header)):
                return None
            spans.append((start, end + len(marker)))
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
