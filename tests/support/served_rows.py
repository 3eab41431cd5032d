"""Conversations as datasets and serving APIs give them, and the reference a server would render from them: the
messages vLLM hands its chat template (string tool-call arguments parsed, ``reasoning`` as ``reasoning_content``),
``apply_chat_template``'s ids, and a loss mask made by a regular expression over the rendered text (each assistant
turn from after ``<|im_start|>assistant\\n`` and what the generation prompt adds after it, through its
``<|im_end|>``), written independently of hsextract."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

CHAT_TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
"""The public Qwen3 and Qwen3.6 chat templates, as their tokenizers ship them."""


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


def call(arguments, name="get_weather", id="c1") -> dict:
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
                        call('{"city": "Paris"}'),
                        call('{"city": "Rome", "days": 2}', id="c2"),
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
                    "tool_calls": [call({"city": "Oslo"}, id="c3")],
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


def reference(
    tokenizer, row: dict, kwargs: dict, chat_template: str | None = None, last_turn_only: bool = False
) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` as a server renders ``row`` (with ``chat_template`` instead of the tokenizer's, if given);
    ``last_turn_only``: the mask on the last assistant turn alone."""
    if chat_template is not None:
        kwargs = {**kwargs, "chat_template": chat_template}
    ids = tokenizer.apply_chat_template(served(row), tools=row.get("tools"), tokenize=True, **kwargs)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = tokenizer.apply_chat_template(served(row), tools=row.get("tools"), tokenize=False, **kwargs)
    spans = assistant_spans(tokenizer, text, kwargs)
    assert len(spans) == sum(m["role"] == "assistant" for m in row["messages"])
    spans = spans[-1:] if last_turn_only else spans
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
    return ids, mask


def assistant_spans(tokenizer, text: str, kwargs: dict) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in ``text``: each from after ``<|im_start|>assistant\\n`` through its
    ``<|im_end|>``. What the generation prompt adds after the role header (``<think>\\n``; the empty think with
    enable_thinking false) is the server's prompt: a turn that opens with it is masked from after it."""
    user = [{"role": "user", "content": "q"}]
    bare = tokenizer.apply_chat_template(user, tokenize=False, **kwargs)
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kwargs)[
        len(bare) :
    ]
    tail = re.escape(prompt.removeprefix("<|im_start|>assistant\n"))
    pattern = rf"<\|im_start\|>assistant\n(?:{tail})?(.*?<\|im_end\|>)"
    return [m.span(1) for m in re.finditer(pattern, text, re.S)]


def qwen_tokenizer(name: str, folder):
    """A tiktoken-style tokenizer carrying the public ``{name}.jinja`` template (qwen3, qwen3_6)."""
    from support.tiktoken_tok import build_tiktoken_style_tokenizer

    template = (CHAT_TEMPLATES / f"{name}.jinja").read_text()
    return build_tiktoken_style_tokenizer(folder, ranks=4000, specials=33, chat_template=template)
