"""A byte-level BPE tokenizer encoded by tiktoken: the same ids and character offsets for much less CPU.

tiktoken merges the lowest-ranked pair, transformers the first-listed merge; both agree when the merges are every
split of a vocabulary entry in id order, as tiktoken vocabularies convert. ``spec_of`` checks that and the rest of
the tokenizer, then every vocabulary entry and a probe both ways; while it runs every ``CHECK_EVERY``-th text is
encoded both ways too. Anything else keeps the tokenizer's own backend; ``HSEXTRACT_TIKTOKEN=0`` turns it off.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hsextract.errors import HsextractError
from hsextract.prepare.fast_tokenizer import OwnBackend

log = logging.getLogger(__name__)

ENV = "HSEXTRACT_TIKTOKEN"

CHECK_EVERY = 256

"""One text in this many is also encoded by the tokenizer's own backend (a small share of a row's cost, though
the backend is much slower than everything else a row costs), the first 16 always."""

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

"""The regex of a ``ByteLevel`` pre-tokenizer with ``use_regex`` (tokenizers' ``byte_level.rs``)."""

PROBES = (
    "hsextract probe: ünïcödé 数字 123\n\t  x ",
    "Hello, world!  It's 3.14159 o'clock\r\n\r\n    def f(x):\n\treturn x ** 2  # ok",
    "emoji 🙂👍🏽 and e\u0301 combining, ﬁ ligature, Ω, 𝔘𝔫𝔦, \u00a0nbsp\u2028sep",
    "   leading spaces, trailing spaces   \n\n\n",
)


class TokenizerDisagrees(HsextractError):
    """tiktoken's ids for a text differ from the tokenizer's own: the preparation stops, nothing is cached."""


@dataclass(frozen=True)
class TiktokenSpec:
    """What a tokenizer process needs to build the encoder: made and checked once, in the parent."""

    pattern: str
    ranks: dict[bytes, int]
    specials: dict[str, int]
    nfc: bool
    unreachable: frozenset[int] = frozenset()
    """Entries BPE does not make from their own text, which tiktoken gives for it as a whole piece."""


def _byte_table() -> dict[int, int]:
    """GPT-2's byte-to-character table, inverted for ``str.translate``: a byte-level vocabulary's text, translated
    and encoded as latin-1, is the entry's bytes."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {c: b for b, c in zip(bs, cs, strict=True)}


def _pattern(pre: dict | None) -> str | None:
    """The one regex a byte-level pre-tokenizer splits with, or None for any other pre-tokenizer."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return None
    split, byte_level = pre["pretokenizers"]
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or "Regex" not in split.get("pattern", {})
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
        or byte_level.get("add_prefix_space")
    ):
        return None
    return split["pattern"]["Regex"]


def _why_not(tokenizer) -> str | TiktokenSpec:
    """The spec, or why this tokenizer keeps its own backend."""
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return "tiktoken is not installed"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "not a fast tokenizer"
    d = json.loads(backend.to_str())
    model = d.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        return "not a plain BPE model"
    if (
        model.get("unk_token") is not None
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return "BPE with an unknown token or word affixes"
    normalizer = d.get("normalizer")
    if normalizer not in (None, {"type": "NFC"}):
        return f"normalizer {normalizer.get('type')}"
    pattern = _pattern(d.get("pre_tokenizer"))
    if pattern is None:
        return "not a byte-level pre-tokenizer with one regex"
    post = d.get("post_processor")
    if post is not None and post.get("type") not in ("TemplateProcessing", "ByteLevel"):
        return f"post-processor {post.get('type')}"
    if post is not None and post.get("type") == "ByteLevel" and post.get("trim_offsets"):
        return "a ByteLevel post-processor that trims offsets"
    added = d.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") or a.get("single_word") or not a.get("content") for a in added):
        return "added tokens that strip or match whole words"
    contents = sorted(a["content"] for a in added)
    if any(b.startswith(a) for a, b in zip(contents, contents[1:], strict=False)):
        return "an added token that begins another"
    specials = {a["content"]: a["id"] for a in added}
    table = _byte_table()

    def to_bytes(text: str) -> bytes:
        return text.translate(table).encode("latin-1")  # UnicodeEncodeError: a character outside the table

    added_ids = set(specials.values())
    try:
        ranks = {to_bytes(text): i for text, i in model["vocab"].items() if i not in added_ids}
        merges = [
            tuple(map(to_bytes, merge.split(" ", 1) if isinstance(merge, str) else merge))
            for merge in model.get("merges") or []
        ]
    except UnicodeEncodeError:
        return "a vocabulary entry or merge that is not byte-level"
    if len(set(ranks.values())) != len(ranks) or any(bytes([b]) not in ranks for b in range(256)):
        return "a byte-level vocabulary without every byte, or with repeated ids"
    last = -1
    merged: set[tuple[bytes, bytes]] = set()
    for pair in merges:
        rank = ranks.get(pair[0] + pair[1])
        if rank is None or rank < last or pair[0] not in ranks or pair[1] not in ranks:
            return "merges not in the order of the entries they make"
        last = rank
        merged.add(pair)
    splits = sum(
        1 for t in ranks if len(t) > 1 for k in range(1, len(t)) if t[:k] in ranks and t[k:] in ranks
    )
    if splits != len(merged) or len(merged) != len(merges):
        return "merges that are not every split of an entry into two entries"
    return TiktokenSpec(pattern=pattern, ranks=ranks, specials=specials, nfc=normalizer is not None)


SPEC_FORMAT = 1


def spec_to_json(spec: TiktokenSpec | None) -> dict:
    """``spec`` (None: tiktoken does not apply) as JSON, for the tokenizer's record (tokenizer_record.py)."""
    import tiktoken

    doc: dict = {"format": SPEC_FORMAT, "tiktoken": tiktoken.__version__, "spec": None}
    if spec is not None:
        doc["spec"] = {
            "pattern": spec.pattern,
            # The entries' bytes end to end, their lengths and ids: read back in ~0.1 s for a 248k vocabulary.
            "entries": base64.b64encode(b"".join(spec.ranks)).decode(),
            "lengths": [len(t) for t in spec.ranks],
            "ids": list(spec.ranks.values()),
            "specials": spec.specials,
            "nfc": spec.nfc,
            "unreachable": sorted(spec.unreachable),
        }
    return doc


def spec_from_json(doc) -> TiktokenSpec | None:
    """The spec ``spec_to_json`` wrote; ValueError when ``doc`` is not one, or was made by another tiktoken."""
    import tiktoken

    if (
        not isinstance(doc, dict)
        or doc.get("format") != SPEC_FORMAT
        or doc.get("tiktoken") != tiktoken.__version__
    ):
        raise ValueError("not a tiktoken spec of this version")
    d = doc.get("spec")
    if d is None:
        return None
    entries, lengths, ids = base64.b64decode(d["entries"], validate=True), d["lengths"], d["ids"]
    if not (
        len(lengths) == len(ids)
        and all(type(n) is int and n > 0 for n in lengths)
        and sum(lengths) == len(entries)
    ):
        raise ValueError("a damaged tiktoken spec")
    ends = list(itertools.accumulate(lengths))
    ranks = {entries[end - n : end]: i for end, n, i in zip(ends, lengths, ids, strict=True)}
    specials, unreachable = d["specials"], d["unreachable"]
    if not (
        len(ranks) == len(ids)
        and all(type(i) is int for i in ids)
        and isinstance(d["pattern"], str)
        and isinstance(d["nfc"], bool)
        and isinstance(specials, dict)
        and all(isinstance(k, str) and type(v) is int for k, v in specials.items())
        and isinstance(unreachable, list)
        and all(type(i) is int for i in unreachable)
    ):
        raise ValueError("a damaged tiktoken spec")
    return TiktokenSpec(d["pattern"], ranks, specials, d["nfc"], frozenset(unreachable))


def disabled() -> bool:
    """``HSEXTRACT_TIKTOKEN=0``: the tokenizer's own backend, always."""
    return os.environ.get(ENV, "").strip() in ("0", "false", "no", "off")


def spec_of(tokenizer) -> TiktokenSpec | None:
    """The checked spec for ``tokenizer``, or None (and why, in the log) when only its own backend is right."""
    if disabled():
        return None
    spec = _why_not(tokenizer)
    if isinstance(spec, str):
        log.info("tokenizing with the tokenizer's own backend (tiktoken does not apply: %s)", spec)
        return None
    reference = OwnBackend(tokenizer)
    if reference.direct is None:
        return None  # a class that encodes its own way: only its call is known right
    fast = TiktokenEncoder(spec, reference, check_every=0)
    for text in (*PROBES, " ".join(spec.specials) + " x"):
        if not fast.agrees(text):
            log.info("tokenizing with the tokenizer's own backend (tiktoken differs on %r)", text[:80])
            return None
    # Every entry's text, encoded both ways (in one batch each): a whole piece of text that is an entry is that
    # entry for tiktoken, while BPE may not reach it. Such entries are kept: a text whose tokens hold one is
    # encoded by the tokenizer's own backend.
    texts, ids = [], []
    for token, token_id in spec.ranks.items():
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            continue  # never a whole piece of text: the merges decide it, checked above
        if not spec.nfc or unicodedata.is_normalized("NFC", text):
            texts.append(text)
            ids.append(token_id)
    theirs = reference.direct.encode_batch(texts, add_special_tokens=False)
    encode = fast.encoding.encode  # not encode_batch: its thread pool costs more than the encoding
    ours = [encode(text, allowed_special="all", disallowed_special=()) for text in texts]
    unreachable = set()
    for text, token_id, a, b in zip(texts, ids, theirs, ours, strict=True):
        if a.ids == b:
            continue
        if b != [token_id]:
            log.info("tokenizing with the tokenizer's own backend (tiktoken differs on %r)", text[:80])
            return None
        unreachable.add(token_id)
    return replace(spec, unreachable=frozenset(unreachable))


class TiktokenEncoder:
    """``ids_and_offsets(text, offsets)`` as the tokenizer's backend gives them, through tiktoken; every
    ``check_every``-th text (and the first 16) compared with ``reference``'s."""

    def __init__(self, spec: TiktokenSpec, reference, check_every: int = CHECK_EVERY):
        import tiktoken

        self.encoding = tiktoken.Encoding(
            "hsextract", pat_str=spec.pattern, mergeable_ranks=spec.ranks, special_tokens=spec.specials
        )
        size = max([*spec.ranks.values(), *spec.specials.values()]) + 1
        self.lengths = np.zeros(size, dtype=np.int64)
        for token, token_id in spec.ranks.items():
            self.lengths[token_id] = len(token)
        for text, token_id in spec.specials.items():
            self.lengths[token_id] = len(text.encode("utf-8"))
        self.nfc, self.reference, self.check_every, self.texts = spec.nfc, reference, check_every, 0
        self.unreachable = np.zeros(size, dtype=bool)
        self.unreachable[list(spec.unreachable)] = True

    def ids_and_offsets(self, text: str, offsets: bool) -> tuple[Sequence[int], np.ndarray | None]:
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            return self.reference(text, offsets)  # offsets through a normalization: the backend's own
        self.texts += 1
        if self.check_every and (self.texts <= 16 or self.texts % self.check_every == 0):
            if not self.agrees(text):
                raise TokenizerDisagrees(
                    f"tiktoken's tokens differ from the tokenizer's own on a text of {len(text)} characters "
                    f"({text[:60]!r}...). Nothing was cached; rerun with {ENV}=0 to tokenize with the "
                    "tokenizer's own backend (and please report the tokenizer)"
                )
        return self._encode(text, offsets)

    def _encode(self, text: str, offsets: bool) -> tuple[np.ndarray, np.ndarray | None]:
        try:  # the ids as an array, not a list of ints
            ids = self.encoding.encode_to_numpy(text, allowed_special="all", disallowed_special=())
        except ValueError:
            # A lone surrogate (UnicodeEncodeError: tiktoken's ``encode`` would store U+FFFD, the tokenizer refuses
            # the text), or the regex engine's backtracking limit (a run of ~1M spaces): the tokenizer's own
            # backend answers, or refuses, as it does without tiktoken.
            return self.reference(text, offsets)
        if self.unreachable[ids].any():
            return self.reference(text, offsets)
        if not offsets:
            return ids, None
        lengths = self.lengths[ids]
        spans = np.empty((len(ids), 2), dtype=np.int64)
        ends = np.cumsum(lengths, out=spans[:, 1])
        np.subtract(ends, lengths, out=spans[:, 0])
        if not text.isascii():  # byte offsets to character offsets: the character each byte belongs to
            raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            char_of = np.cumsum((raw & 0xC0) != 0x80) - 1
            spans[:, 0], spans[:, 1] = char_of[spans[:, 0]], char_of[spans[:, 1] - 1] + 1
        return ids, spans

    def agrees(self, text: str) -> bool:
        """Both encoders give ``text`` the same ids and character offsets (a text NFC would change is never
        given to tiktoken)."""
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            return True
        want_ids, want_offsets = self.reference(text, True)
        ids, got_offsets = self._encode(text, True)
        return list(ids) == list(want_ids) and np.array_equal(
            got_offsets, np.asarray(want_offsets, dtype=np.int64).reshape(-1, 2)
        )
