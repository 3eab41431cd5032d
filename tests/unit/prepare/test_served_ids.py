"""Rows as the server read and wrote them, over the public Qwen3 and Qwen3.6 templates: ``--rows per-turn`` gives,
for every turn, exactly ``apply_chat_template`` of that turn's messages with the loss on that turn alone; the
server's ids stored by ``regenerate`` are the row's ids exactly (not a re-tokenization of the text); a server that
rendered with another template is caught and its first difference named; a reply cut at ``max_tokens`` ends where
the model stopped, with no end-of-turn token it never produced, in ids or mask.

The "server" here is transformers' own ``apply_chat_template`` with ``add_generation_prompt`` (what vLLM and
SGLang run), and its completions are tokenized one character at a time: valid ids no tokenizer would produce from
the text, so only ids taken from the row can match them.
"""

from __future__ import annotations

import copy

import pytest
from support.served_rows import (
    CHAT_TEMPLATES,
    assistant_spans,
    conversations,
    qwen_tokenizer,
    reference,
    served,
)

from hsextract.demo import write_jsonl
from hsextract.prepare.chat import ChatOptions
from hsextract.prepare.tokenize import load_samples

# Real templates rendered turn by turn (and a loopback server): the slow tier, to keep the fast one in its budget.
pytestmark = pytest.mark.slow

THINKING = {"enable_thinking": True}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_6"])
def qwen(request, tmp_path_factory):
    return request.param, qwen_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def by_id(samples) -> dict:
    return {sid: samples.sample(i) for i, sid in enumerate(samples.sample_ids)}


def turns_of(row: dict) -> list[int]:
    """Indexes of the assistant messages of ``row``."""
    return [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]


@pytest.mark.parametrize(
    "kwargs", [{}, THINKING, {"preserve_thinking": True}], ids=["none", "thinking", "preserve"]
)
def test_per_turn_rows_equal_apply_chat_template_of_each_turn_with_the_loss_on_it_alone(
    tmp_path, qwen, kwargs
):
    _, tok = qwen
    rows = conversations()
    path = write_jsonl(rows, tmp_path / "rows.jsonl")

    samples, report = load_samples(
        str(path), tok, max_length=8192, chat=ChatOptions.of(None, kwargs, "per-turn")
    )

    got = by_id(samples)
    want_ids = [f"{row['id']}#t{k}" for row in rows for k in range(1, len(turns_of(row)) + 1)]
    assert samples.sample_ids == want_ids
    assert report.kept == len(want_ids) and report.skipped_malformed == 0, report.examples
    for row in rows:
        for k, i in enumerate(turns_of(row), 1):
            turn = {**row, "messages": row["messages"][: i + 1]}
            ids, mask = got[f"{row['id']}#t{k}"]
            want, want_mask = reference(tok, turn, kwargs, last_turn_only=True)
            assert ids.tolist() == want, (row["id"], k)
            assert mask.tolist() == want_mask, (row["id"], k)


def regenerated(
    tok, row: dict, kwargs: dict, cut_last: bool = False, server_template: str | None = None
) -> dict:
    """``row`` as ``hsextract regenerate`` stores it from a server that returns ids: each reply with the prompt
    ids the server rendered for its turn and its completion ids (one token per character, then ``<|im_end|>``
    unless the reply was cut)."""
    out = copy.deepcopy(row)
    messages = served(row)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    template = {"chat_template": server_template} if server_template else {}
    for i in turns_of(row):
        prompt = tok.apply_chat_template(
            messages[:i],
            tools=row.get("tools"),
            add_generation_prompt=True,
            tokenize=True,
            **kwargs,
            **template,
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        text = messages[i].get("content") or "x"
        completion = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]
        cut = cut_last and i == turns_of(row)[-1]
        out["messages"][i].update(
            prompt_token_ids=prompt,
            token_ids=completion if cut else [*completion, end],
            finish_reason="length" if cut else "stop",
        )
    return out


def test_the_servers_ids_are_each_turns_row_exactly_and_its_completion_the_loss(tmp_path, qwen):
    _, tok = qwen
    rows = [regenerated(tok, row, THINKING) for row in conversations()]
    path = write_jsonl(rows, tmp_path / "rows.jsonl")

    samples, report = load_samples(
        str(path), tok, max_length=8192, chat=ChatOptions.of(None, THINKING, "per-turn")
    )

    got = by_id(samples)
    for row in rows:
        for k, i in enumerate(turns_of(row), 1):
            reply = row["messages"][i]
            ids, mask = got[f"{row['id']}#t{k}"]
            assert ids.tolist() == reply["prompt_token_ids"] + reply["token_ids"], (row["id"], k)
            assert mask.tolist() == [0] * len(reply["prompt_token_ids"]) + [1] * len(reply["token_ids"])
    assert report.token_ids == {"server": len(samples)}, report.examples


def test_one_row_per_conversation_is_the_last_turns_ids_with_every_turn_in_the_loss(tmp_path, qwen):
    _, tok = qwen
    rows = [regenerated(tok, row, THINKING) for row in conversations()]
    path = write_jsonl(rows, tmp_path / "rows.jsonl")

    samples, report = load_samples(str(path), tok, max_length=8192, chat=ChatOptions.of(None, THINKING))

    for n, row in enumerate(rows):
        ids, mask = samples.sample(n)
        last = row["messages"][turns_of(row)[-1]]
        prompt = last["prompt_token_ids"]
        assert ids.tolist() == prompt + last["token_ids"]
        # The earlier turns, as the server rendered them in the last prompt, are in the loss as the text path
        # masks them; the last turn is its completion.
        before = {**conversations()[n], "messages": conversations()[n]["messages"][: turns_of(row)[-1]]}
        _, text_mask = reference_prompt(tok, before, THINKING)
        assert mask.tolist() == text_mask + [1] * len(last["token_ids"]), row["id"]
    assert report.token_ids == {"server": len(rows)}


def reference_prompt(tok, row: dict, kwargs: dict) -> tuple[list[int], list[int]]:
    """A request's ids (the messages and the generation prompt) and the mask of its assistant turns, by the
    regular expression of ``reference``."""
    text = tok.apply_chat_template(
        served(row), tools=row.get("tools"), add_generation_prompt=True, tokenize=False, **kwargs
    )
    spans = assistant_spans(tok, text, kwargs)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]


def test_a_server_that_rendered_another_template_is_counted_with_its_first_difference(tmp_path, qwen):
    name, tok = qwen
    other = (CHAT_TEMPLATES / ("qwen3.jinja" if name == "qwen3_6" else "qwen3_6.jinja")).read_text()
    rows = conversations()
    served_rows = [regenerated(tok, row, THINKING, server_template=other) for row in rows]
    path = write_jsonl(served_rows, tmp_path / "rows.jsonl")

    samples, report = load_samples(str(path), tok, max_length=8192, chat=ChatOptions.of(None, THINKING))

    assert report.token_ids["server"] == len(rows)
    assert 0 < report.token_ids["prompt_differs"] <= len(rows)
    first = next(e for e in report.examples if e["kind"] == "prompt_differs")
    assert first["reason"].startswith("turn ") and "the server has" in first["reason"], first
    assert "server prompt ids differ" in report.summary()
    assert any("differ from hsextract's rendering" in w for w in report.rendering_lines()[0])
    # The ids are still the server's: they are what the target read.
    last = served_rows[0]["messages"][turns_of(rows[0])[-1]]
    assert samples.sample(0)[0].tolist() == last["prompt_token_ids"] + last["token_ids"]


def test_the_same_template_reports_no_difference(tmp_path, qwen):
    _, tok = qwen
    rows = [regenerated(tok, row, THINKING) for row in conversations()]
    _, report = load_samples(
        str(write_jsonl(rows, tmp_path / "rows.jsonl")),
        tok,
        max_length=8192,
        chat=ChatOptions.of(None, THINKING),
    )
    assert "prompt_differs" not in report.token_ids and not report.rendering_lines()[0]


def test_a_cut_reply_with_the_servers_ids_ends_where_the_server_stopped(tmp_path, qwen):
    _, tok = qwen
    end = tok.convert_tokens_to_ids("<|im_end|>")
    row = regenerated(tok, conversations()[0], THINKING, cut_last=True)
    samples, _ = load_samples(
        str(write_jsonl([row], tmp_path / "rows.jsonl")),
        tok,
        max_length=8192,
        chat=ChatOptions.of(None, THINKING),
    )
    ids, mask = samples.sample(0)
    last = row["messages"][-1]
    assert ids.tolist() == last["prompt_token_ids"] + last["token_ids"]
    assert ids[-1] != end and ids[mask.astype(bool)].tolist().count(end) == 2  # the two earlier turns end


def test_a_cut_reply_rendered_from_text_has_no_end_of_turn_token_in_ids_or_mask(tmp_path, qwen):
    _, tok = qwen
    end = tok.convert_tokens_to_ids("<|im_end|>")
    row = {
        "id": "cut",
        "messages": [
            {"role": "user", "content": "Count to ten."},
            {"role": "assistant", "content": "One, two", "finish_reason": "length"},
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "One, two, three", "finish_reason": "length"},
        ],
    }
    for rows_mode in ("conversation", "per-turn"):
        samples, _ = load_samples(
            str(write_jsonl([row], tmp_path / f"{rows_mode}.jsonl")),
            tok,
            max_length=8192,
            chat=ChatOptions.of(None, {}, rows_mode),
        )
        for n in range(len(samples)):
            ids, mask = samples.sample(n)
            text = tok.apply_chat_template(
                served(row)[: 2 * n + 2 if rows_mode == "per-turn" else 4], tokenize=False
            )
            said = text[: text.rfind("<|im_end|>")]
            assert ids.tolist() == tok.encode(said, add_special_tokens=False), (rows_mode, n)
            assert end not in ids[mask.astype(bool)].tolist(), (rows_mode, n)
            assert tok.decode(ids[mask.astype(bool)].tolist()).endswith(
                "three" if n or rows_mode == "conversation" else "two"
            )
