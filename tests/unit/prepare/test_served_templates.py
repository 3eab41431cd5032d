"""The tokens a server feeds the target, with the real public Qwen3 and Qwen3.6 chat templates.

Against transformers itself: ids equal to ``tokenizer.apply_chat_template(messages, tools=..., tokenize=True,
**kwargs)`` on the same messages (string tool-call arguments parsed, as vLLM does), and a loss mask equal to a
reference made by a regular expression over the rendered text (every assistant turn from after
``<|im_start|>assistant\\n`` through its ``<|im_end|>``, nothing of system, user or tool turns), mapped to tokens by
the tokenizer's own offsets. Both tokenization paths (tiktoken's and the tokenizer's own backend) give the same.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
from support.tiktoken_tok import build_tiktoken_style_tokenizer

from hsextract.demo import write_jsonl
from hsextract.prepare.chat import ChatOptions, RowEncoder
from hsextract.prepare.tiktoken_bpe import spec_of
from hsextract.prepare.tokenize import load_samples

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def _call(arguments, name="get_weather", id="c1") -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def conversations() -> list[dict]:
    """Rows as datasets and serving APIs give them: reasoning in several turns (``reasoning_content``, vLLM's
    ``reasoning``, inline ``<think>``), tool calls with string and object arguments, tool responses, systems."""
    return [
        {
            "id": "reasoning-in-every-turn",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "reasoning_content": "Two and two.", "content": "4"},
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "reasoning_content": "Three and three.", "content": "6"},
                {"role": "user", "content": "Thanks! And times two?"},
                {
                    "role": "assistant",
                    "reasoning_content": "Six twice.",
                    "content": "12, and 8 for the first.",
                },
            ],
        },
        {
            "id": "tools-string-arguments",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "I should call the tool twice.",
                    "tool_calls": [
                        _call('{"city": "Paris"}'),
                        _call('{"city": "Rome", "days": 2}', id="c2"),
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                {
                    "role": "assistant",
                    "reasoning_content": "Both answered.",
                    "content": "Paris sun, Rome rain.",
                },
                {"role": "user", "content": "And Oslo?"},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [_call({"city": "Oslo"}, id="c3")],
                },
                {"role": "tool", "tool_call_id": "c3", "content": "snow"},
                {"role": "assistant", "content": "Oslo: snow."},
            ],
        },
        {
            "id": "vllm-reasoning-field",
            "messages": [
                {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "reasoning": "A greeting.", "content": "Hello!"},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "reasoning": "A farewell.", "content": "Goodbye!"},
            ],
        },
        {
            "id": "inline-think",
            "messages": [
                {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "<think>\nSmall ones.\n</think>\n\n7"},
                {"role": "user", "content": "Another?"},
                {"role": "assistant", "content": "<think>\nNot 7.\n</think>\n\n11"},
            ],
        },
    ]


def served(row: dict) -> list[dict]:
    """The messages as vLLM hands them to the template: string arguments parsed, ``reasoning`` as
    ``reasoning_content``, None keys dropped. Written here independently of the code under test."""
    out = []
    for m in copy.deepcopy(row["messages"]):
        m = {k: v for k, v in m.items() if v is not None}
        if "reasoning" in m:
            m["reasoning_content"] = m.pop("reasoning")
        if m["role"] == "assistant" and "content" not in m:
            m["content"] = ""
        for call in m.get("tool_calls", []):
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(m)
    return out


def reference(tokenizer, row: dict, kwargs: dict) -> tuple[list[int], list[int]]:
    ids = tokenizer.apply_chat_template(served(row), tools=row.get("tools"), tokenize=True, **kwargs)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = tokenizer.apply_chat_template(served(row), tools=row.get("tools"), tokenize=False, **kwargs)
    spans = [m.span(1) for m in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, re.S)]
    assert len(spans) == sum(m["role"] == "assistant" for m in row["messages"])
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
    return ids, mask


KWARGS = [
    {},
    {"enable_thinking": True},
    {"enable_thinking": False},
    {"preserve_thinking": True},
    {"preserve_thinking": False, "enable_thinking": False},
]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_6"])
def qwen(request, tmp_path_factory):
    template = (TEMPLATES / f"{request.param}.jinja").read_text()
    tok = build_tiktoken_style_tokenizer(
        tmp_path_factory.mktemp(request.param), specials=33, chat_template=template
    )
    return request.param, tok


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
    plain = build_tiktoken_style_tokenizer(tmp_path / "plain", specials=33)
    template = (TEMPLATES / f"{name}.jinja").read_text()
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

    # Both templates drop the reasoning of turns before the last user query; Qwen3.6 keeps it when asked.
    assert dropped.unrendered == {"reasoning": 3}  # the rows with reasoning_content (or reasoning)
    assert dropped.sources[0]["unrendered"] == {"reasoning": 3}
    assert "reasoning not rendered in 3 rows" in dropped.summary()
    assert kept.unrendered == ({} if name == "qwen3_6" else {"reasoning": 3})


def test_tool_call_arguments_that_are_not_json_make_the_row_malformed_and_counted(tmp_path, qwen):
    _, tok = qwen
    bad = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("{city: Paris")]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ]
    }
    path = write_jsonl([bad, conversations()[0]], tmp_path / "rows.jsonl")

    _, report = load_samples(str(path), tok, max_length=4096)

    assert (report.kept, report.skipped_malformed) == (1, 1)
    assert "tool call 0 has 'arguments' that are not JSON" in report.examples[0]["reason"]
