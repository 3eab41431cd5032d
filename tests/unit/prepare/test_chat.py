"""Long rows cut to ``--max-length`` are tokenized only as far as the cut needs, with the same ids and mask as the
whole row tokenized by the tokenizer itself and cut; under ``skip`` a row that cannot fit is refused untokenized."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from hsextract.demo import build_tokenizer, write_jsonl
from hsextract.prepare.tokenize import load_samples

PIECES = [
    "alpha",
    "beta",
    " ",
    "  ",
    "\n",
    "\t",
    "=",
    "(x)",
    "12",
    "3.14",
    "é",
    "naïve",
    "中文",
    "😀",
    "--",
    "'s",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def varied_text(chars: int, seed: int) -> str:
    """Words, digits, runs of spaces, accents, CJK and emoji: cuts fall at every kind of token boundary."""
    rng = random.Random(seed)
    parts, n = [], 0
    while n < chars:
        part = rng.choice(PIECES) * rng.choice((1, 1, 1, 2, 7))
        parts.append(part)
        n += len(part)
    return "".join(parts)[:chars]


def reference_chat(tokenizer, messages, content: str, max_length: int):
    """Ids and mask of the whole conversation tokenized by the tokenizer itself, then cut: a token is learned where
    it overlaps the assistant's content or the end-of-turn token after it (the conversation has one such turn)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    start = text.index(content)
    end = start + len(content) + len("<|im_end|>")
    mask = [int(a < end and b > start and b > a) for a, b in encoding["offset_mapping"]]
    return encoding["input_ids"][:max_length], mask[:max_length]


def load(path, tokenizer, **kwargs):
    return load_samples(path, tokenizer, progress=False, num_proc=1, **kwargs)


@pytest.mark.parametrize("max_length", [1, 37, 300])
def test_long_rows_cut_early_equal_the_whole_row_tokenized_and_cut(tmp_path, tokenizer, max_length):
    rows, expected = [], []
    for seed in range(4):
        text = varied_text(40_000 + 997 * seed, seed)
        rows.append({"id": f"text-{seed}", "text": text})
        expected.append(
            (tokenizer(text, add_special_tokens=False)["input_ids"][:max_length], [1] * max_length)
        )
        content = varied_text(30_000 + 331 * seed, 100 + seed)
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "write"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": "more"},
        ]
        rows.append({"id": f"chat-{seed}", "messages": messages})
        expected.append(reference_chat(tokenizer, messages, content, max_length))
    samples, report = load(write_jsonl(rows, tmp_path / "long.jsonl"), tokenizer, max_length=max_length)
    kept = {sid: samples.sample(i) for i, sid in enumerate(samples.sample_ids)}
    for row, (ids, mask) in zip(rows, expected, strict=True):
        if not any(
            mask
        ):  # the cut leaves no assistant token: refused as empty, as the whole row cut would be
            assert row["id"] not in kept
            continue
        got_ids, got_mask = kept[row["id"]]
        assert got_ids.tolist() == ids, row["id"]
        assert got_mask.tolist() == mask, row["id"]
    # The early cut is what ran: the reason says the row is over the limit, not how many tokens it has in all.
    assert report.truncated == len(kept)
    reasons = [e["reason"] for e in report.examples if e["kind"] == "truncated"]
    assert reasons and all(r.startswith(f"over {max_length} tokens (") for r in reasons), reasons


def test_under_skip_a_row_far_too_long_is_refused_and_one_just_over_is_measured(tmp_path, tokenizer):
    just_over = varied_text(3000, 1)
    n = len(tokenizer(just_over, add_special_tokens=False)["input_ids"])
    fits = varied_text(200, 2)
    rows = [
        {"id": "far", "text": varied_text(1_000_000, 3)},
        {"id": "just-over", "text": just_over},
        {"id": "fits", "text": fits},
    ]
    samples, report = load(
        write_jsonl(rows, tmp_path / "skip.jsonl"), tokenizer, max_length=n - 1, too_long="skip"
    )
    assert samples.sample_ids == ["fits"]
    reasons = {e["id"]: e["reason"] for e in report.examples if e["kind"] == "too_long"}
    assert reasons["far"].startswith("1000000 characters: over max_length"), reasons
    assert reasons["just-over"] == f"{n} tokens > max_length {n - 1}", reasons


@pytest.mark.slow
def test_a_50_mb_row_is_cut_in_seconds(tmp_path, tokenizer):
    """It tokenized for 87 s (docs/PERFORMANCE.md) before it was cut to 300 tokens."""
    text = varied_text(1_000_000, 5) * 50
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:
        for row in (
            {"id": "text", "text": text},
            {
                "id": "chat",
                "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": text}],
            },
        ):
            f.write(json.dumps(row) + "\n")
    start = time.monotonic()
    samples, report = load(path, tokenizer, max_length=300)
    seconds = time.monotonic() - start
    assert seconds < 30, f"{seconds:.0f} s"
    assert report.truncated == 2 and np.diff(samples.offsets).tolist() == [300, 300]
    assert (
        samples.sample(0)[0].tolist() == tokenizer(text[:20_000], add_special_tokens=False)["input_ids"][:300]
    )


def test_the_mask_marks_exactly_the_tokens_overlapping_a_span():
    """Against a token-by-token reference: random tokens (some empty, as a backend gives for some added tokens) and
    random sorted, disjoint spans."""
    from hsextract.prepare.chat import _mask_from_spans

    rng = random.Random(5)
    for _ in range(300):
        offsets, at = [], 0
        for _ in range(rng.randint(0, 40)):
            n = rng.choice([0, 1, 1, 2, 3, 7])
            offsets.append((at, at + n))
            at += n
        cuts = sorted(rng.sample(range(at + 2), min(at + 2, 2 * rng.randint(0, 3))))
        spans = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
        want = [int(b > a and any(a < e and b > s for s, e in spans)) for a, b in offsets]
        got = _mask_from_spans(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
        assert got.tolist() == want, (offsets, spans)
