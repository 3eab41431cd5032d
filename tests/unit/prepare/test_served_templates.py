"""The tokens a server feeds the target, with the real public Qwen3 and Qwen3.6 chat templates.

Against transformers itself: ids equal to ``tokenizer.apply_chat_template(messages, tools=..., tokenize=True,
**kwargs)`` on the same messages (string tool-call arguments parsed, as vLLM does), and a loss mask equal to a
reference made by a regular expression over the rendered text (every assistant turn from after
``<|im_start|>assistant\\n`` through its ``<|im_end|>``, nothing of system, user or tool turns), mapped to tokens by
the tokenizer's own offsets. Both tokenization paths (tiktoken's and the tokenizer's own backend) give the same.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.served_rows import CHAT_TEMPLATES, call, conversations, qwen_tokenizer, reference
from support.tiktoken_tok import build_tiktoken_style_tokenizer

from hsextract.demo import write_jsonl
from hsextract.prepare.chat import ChatOptions, RowEncoder, marked_text
from hsextract.prepare.tiktoken_bpe import spec_of
from hsextract.prepare.tokenize import load_samples

# Real templates rendered turn by turn (and a loopback server): the slow tier, to keep the fast one in its budget.
pytestmark = pytest.mark.slow

KWARGS = [
    {},
    {"enable_thinking": True},
    {"enable_thinking": False},
    {"preserve_thinking": True},
    {"preserve_thinking": False, "enable_thinking": False},
]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_6"])
def qwen(request, tmp_path_factory):
    return request.param, qwen_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("kwargs", KWARGS, ids=lambda k: json.dumps(k) if k else "no-kwargs")
def test_every_row_is_kept_with_the_ids_and_mask_transformers_gives(tmp_path, qwen, kwargs):
    _, tok = qwen
    rows = conversations()
    path = write_jsonl(rows, tmp_path / "rows.jsonl")

    samples, report = load_samples(str(path), tok, max_length=4096, chat=ChatOptions.of(None, kwargs))

    assert (report.rows, report.kept, report.skipped_malformed) == (len(rows), len(rows), 0), report.examples
    for i, row in enumerate(rows):
        ids, mask = samples.sample(i)
        want_ids, want_mask = reference(tok, row, kwargs)
        assert ids.tolist() == want_ids, row["id"]
        assert mask.tolist() == want_mask, row["id"]


@pytest.mark.parametrize("kwargs", [{}, {"preserve_thinking": True}])
def test_the_fast_path_and_the_tokenizers_own_backend_agree(qwen, kwargs):
    _, tok = qwen
    chat = ChatOptions.of(None, kwargs)
    own = RowEncoder(tok, 4096, "truncate", tiktoken=None, chat=chat)
    fast = RowEncoder(tok, 4096, "truncate", tiktoken=spec_of(tok), chat=chat)
    assert fast.fast is not None and own.fast is None
    for i, row in enumerate(conversations()):
        a, b = own.encode(i, row), fast.encode(i, row)
        assert a[2] == b[2] == "kept"
        assert np.array_equal(a[4], b[4]) and np.array_equal(a[5], b[5])


def test_a_template_given_replaces_the_tokenizers_and_its_arguments_reach_every_rendering(tmp_path, qwen):
    """The demo's ChatML tokenizer rendering with Qwen3.6's template, as a server started with
    ``--chat-template qwen3_6.jinja``: the same ids as the tokenizer whose own template that is."""
    name, tok = qwen
    plain = build_tiktoken_style_tokenizer(tmp_path / "plain", ranks=4000, specials=33)
    template = (CHAT_TEMPLATES / f"{name}.jinja").read_text()
    rows = conversations()
    path = write_jsonl(rows, tmp_path / "rows.jsonl")
    kwargs = {"preserve_thinking": True}

    given, _ = load_samples(str(path), plain, max_length=4096, chat=ChatOptions.of(template, kwargs))
    own, _ = load_samples(str(path), tok, max_length=4096, chat=ChatOptions.of(None, kwargs))
    default, _ = load_samples(str(path), plain, max_length=4096)

    for i in range(len(rows)):
        assert given.sample(i)[0].tolist() == own.sample(i)[0].tolist()
        assert given.sample(i)[1].tolist() == own.sample(i)[1].tolist()
    assert any(given.sample(i)[0].tolist() != default.sample(i)[0].tolist() for i in range(len(rows)))


def test_what_the_template_drops_is_counted_per_source(tmp_path, qwen):
    name, tok = qwen
    path = write_jsonl(conversations(), tmp_path / "rows.jsonl")

    _, dropped = load_samples(str(path), tok, max_length=4096)
    _, kept = load_samples(
        str(path), tok, max_length=4096, chat=ChatOptions.of(None, {"preserve_thinking": True})
    )

    # Both templates drop the reasoning of turns before the last user query, as the server does; Qwen3.6 keeps it
    # when asked. The last replies' reasoning is rendered: nothing the dry run fails for.
    assert dropped.unrendered == {"earlier reasoning": 3}  # the rows with reasoning_content (or reasoning)
    assert dropped.sources[0]["unrendered"] == {"earlier reasoning": 3}
    assert "earlier reasoning not rendered in 3 rows" in dropped.summary()
    assert kept.unrendered == ({} if name == "qwen3_6" else {"earlier reasoning": 3})
    warnings, notes = dropped.rendering_lines("sampled ")
    assert not warnings
    assert notes == [
        "3 of 4 sampled rows carry earlier reasoning that the chat template drops, as the server does (counted)"
    ]


def test_tool_call_arguments_that_are_not_json_make_the_row_malformed_and_counted(tmp_path, qwen):
    _, tok = qwen
    bad = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call("{city: Paris")]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ]
    }
    path = write_jsonl([bad, conversations()[0]], tmp_path / "rows.jsonl")

    _, report = load_samples(str(path), tok, max_length=4096)

    assert (report.kept, report.skipped_malformed) == (1, 1)
    assert "tool call 0 has 'arguments' that are not JSON" in report.examples[0]["reason"]


def test_the_dry_runs_marked_sample_brackets_exactly_the_assistant_turns(qwen):
    _, tok = qwen
    row = conversations()[1]
    ids, mask = reference(tok, row, {})

    marked = marked_text(tok, ids, mask, limit=10**6)

    parts = marked.split("«")
    assert len(parts) - 1 == sum(m["role"] == "assistant" for m in row["messages"])
    # a turn opens after its role header, and after the generation prompt's <think> where it repeats it (a token
    # that straddles the prompt's newline and the model's is the model's)
    opened = ("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>")
    assert all(before.rsplit("»", 1)[-1].endswith(opened) for before in parts[:-1])
    assert all(turn.split("»")[0].endswith("<|im_end|>") for turn in parts[1:])
    assert marked.replace("«", "").replace("»", "") == tok.decode(ids)


def test_a_reply_cut_short_inside_its_reasoning_is_kept_as_the_server_returned_it(tmp_path, qwen):
    """``max_tokens`` reached inside ``<think>``: servers return ``content: null`` and the reasoning alone."""
    _, tok = qwen
    row = {
        "id": "cut",
        "messages": [
            {"role": "user", "content": "Prove it."},
            {"role": "assistant", "content": None, "reasoning": "Let me think about this for a"},
        ],
    }
    path = write_jsonl([row], tmp_path / "rows.jsonl")

    samples, report = load_samples(str(path), tok, max_length=4096)

    assert report.kept == 1, report.examples
    assert samples.sample(0)[0].tolist() == reference(tok, row, {})[0]


def test_the_empty_think_the_server_prompts_with_is_not_masked_as_the_models_words(qwen):
    """With enable_thinking false the generation prompt ends in ``<think>\\n\\n</think>\\n\\n``: the server wrote it, the
    model wrote what follows."""
    _, tok = qwen
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    encoder = RowEncoder(tok, 4096, "truncate", chat=ChatOptions.of(None, {"enable_thinking": False}))
    _, _, status, _, ids, mask = encoder.encode(0, row)
    marked = marked_text(tok, ids, mask, limit=10**6)
    assert status == "kept" and marked.endswith("<think>\n\n</think>\n\n«Hello there.<|im_end|>»\n"), marked


def test_dropped_reasoning_is_counted_per_turn_even_when_its_text_appears_elsewhere(tmp_path, qwen):
    """The count renders each turn's reasoning as its own mark: an earlier turn's reasoning that the last reply
    repeats is still dropped (a substring test took it for rendered)."""
    _, tok = qwen
    row = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "Four.", "content": "4"},
            {"role": "user", "content": "Say it in words."},
            {"role": "assistant", "reasoning_content": "Spell it.", "content": "Four."},
        ]
    }
    encoder = RowEncoder(tok, 4096, "truncate")
    assert encoder.encode(0, row)[2] == "kept"
    assert encoder.unrendered == ("earlier reasoning",)


def test_reasoning_of_the_last_reply_left_out_is_the_one_dry_run_warning(tmp_path):
    """A template without reasoning (the demo's ChatML one) leaves out what the model wrote in its reply."""
    plain = build_tiktoken_style_tokenizer(tmp_path / "plain", ranks=4000, specials=33)
    row = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning": "Greet.", "content": "Hey"},
        ]
    }
    path = write_jsonl([row, row], tmp_path / "rows.jsonl")
    _, report = load_samples(str(path), plain, max_length=4096)
    assert report.unrendered == {"reasoning": 2}
    warnings, notes = report.rendering_lines()
    assert not notes and len(warnings) == 1
    assert warnings[0].startswith("2 of 2 rows carry reasoning in a reply after the last user message")


@pytest.mark.parametrize("arguments", ["", None, {}])
def test_a_tool_call_without_arguments_renders_as_an_empty_object_as_vllm_does(qwen, arguments):
    """vLLM sets empty or absent ``arguments`` (a tool without parameters) to ``{}`` before rendering."""
    _, tok = qwen
    row = {
        "tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "", "tool_calls": [call(arguments, name="now")]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
            {"role": "assistant", "content": "Noon."},
        ],
    }
    _, _, status, reason, ids, _ = RowEncoder(tok, 4096, "truncate").encode(0, row)
    assert status == "kept", reason
    served = {**row, "messages": [*row["messages"]]}
    served["messages"][1] = {**row["messages"][1], "tool_calls": [call({}, name="now")]}
    assert ids.tolist() == reference(tok, served, {})[0]


def test_reasoning_wins_over_a_stale_reasoning_content_as_in_vllm_and_the_conflict_is_counted(tmp_path, qwen):
    """vLLM hands the template ``reasoning or reasoning_content`` under both names: a turn with both renders its
    ``reasoning``; a different, non-empty ``reasoning_content`` beside it is counted."""
    _, tok = qwen
    both = {
        "role": "assistant",
        "reasoning": "Fresh thought.",
        "reasoning_content": "Stale thought.",
        "content": "A",
    }
    rows = [
        {"messages": [{"role": "user", "content": "Q"}, both]},
        {"messages": [{"role": "user", "content": "Q"}, {**both, "reasoning": ""}]},  # empty: the other one
        {"messages": [{"role": "user", "content": "Q"}, {**both, "reasoning_content": "Fresh thought."}]},
    ]
    path = write_jsonl(rows, tmp_path / "rows.jsonl")
    samples, report = load_samples(str(path), tok, max_length=4096)
    texts = [tok.decode(samples.sample(i)[0].tolist()) for i in range(3)]
    assert "Fresh thought." in texts[0] and "Stale thought." not in texts[0]
    assert "Stale thought." in texts[1]
    assert report.unrendered == {"stale reasoning_content": 1}
    assert "stale reasoning_content not rendered in 1 rows" in report.summary()
