"""Rows -> messages as a server takes them: OpenAI chat (content parts, tool calls, reasoning) and ShareGPT.

Servers normalize before rendering, and so does this: tool-call ``arguments`` given as a JSON string become the
object (vLLM parses them; Qwen3.6's template iterates over them and fails on a string, Qwen3's writes the string
verbatim), ``reasoning`` (vLLM's newer name) is read as ``reasoning_content``, and keys that Arrow filled with None
are dropped. A row that cannot be read raises ``_RowSkipped`` with its kind and reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool")


SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


@dataclass(frozen=True)
class UnreadableRow:
    """A JSONL line that is not valid JSON; ``read_rows`` yields it in the line's place so that it is counted."""

    reason: str


class _RowSkipped(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason

    def __reduce__(self):  # tokenizer pools send it back to the parent
        return type(self), (self.kind, self.reason)


def _malformed(reason: str) -> _RowSkipped:
    return _RowSkipped("malformed", reason)


ROW_FIELDS = ("messages", "conversations", "input_ids", "text")

"""The fields a row is read from, in the order tried."""

FIELDS_SHOWN = 6


def no_row_field(row: dict) -> _RowSkipped:
    """A row with none of ``ROW_FIELDS``, naming the fields it has (those Arrow filled with None left out), so that
    a wrong column is seen at once: ``... (its fields: 'dialog', 'id')``."""
    keys = sorted(repr(str(k)) for k, v in row.items() if v is not None)
    shown = ", ".join(keys[:FIELDS_SHOWN]) + (
        f" and {len(keys) - FIELDS_SHOWN} more" if len(keys) > FIELDS_SHOWN else ""
    )
    return _malformed(
        "row has none of the fields " + ", ".join(map(repr, ROW_FIELDS)) + f" (its fields: {shown or 'none'})"
    )


def _drop_nones(value: Any) -> Any:
    """Remove None-valued keys: Arrow (parquet, datasets) fills keys a row lacks with None when rows differ."""
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nones(v) for v in value]
    return value


def _text_parts(content: Any, i: int, role: str) -> Any:
    """OpenAI's list of content parts -> one string; anything else is returned as it is."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _malformed(
                f"message {i} ({role}) has a content part of type {kind!r}; only text parts are read"
            )
    return "".join(texts)


class Messages(list):
    """A conversation's messages as the server hands them to the template; ``conflicts``: its turns whose
    ``reasoning_content`` differs from the ``reasoning`` rendered in its place (counted in the data report)."""

    conflicts = 0


def _chat_messages(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise _malformed(f"'messages' is a {type(value).__name__}, not a list")
    messages = Messages()
    for i, message in enumerate(_drop_nones(value)):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = {**message, "content": _text_parts(message["content"], i, message.get("role"))}
        if not isinstance(message, dict) or "role" not in message:
            raise _malformed(f"message {i} is not an object with a 'role'")
        role = message["role"]
        if role not in CHAT_ROLES:
            raise _malformed(
                f"message {i} has unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        # OpenAI style: content null next to tool calls, or after reasoning cut short by max_tokens.
        said = message.get("tool_calls") or message.get("reasoning_content") or message.get("reasoning")
        if "content" not in message and role == "assistant" and said:
            message = {**message, "content": ""}
        if not isinstance(message.get("content"), str):
            raise _malformed(f"message {i} ({role}) has no string 'content'")
        # vLLM's rule: ``reasoning`` (its newer name) wins unless empty, and the template gets it under both names.
        chosen = message.get("reasoning") or message.get("reasoning_content")
        stale = message.get("reasoning_content")
        if message.get("reasoning") and isinstance(stale, str) and stale.strip() and stale != chosen:
            messages.conflicts += 1
        message = {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_content")}
        if chosen is not None and role == "assistant":
            message.update(reasoning=chosen, reasoning_content=chosen)
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise _malformed(f"message {i} ({role}) has a 'reasoning_content' that is not a string")
        if message.get("tool_calls") is not None:
            message = {**message, "tool_calls": _tool_calls(message["tool_calls"], i)}
        messages.append(message)
    return messages


def _tool_calls(calls: Any, i: int) -> list:
    """OpenAI's tool calls with ``arguments`` as a JSON string -> the object, as vLLM parses them before rendering
    (tool-use templates iterate over the arguments; Qwen3's would write the string verbatim); arguments empty
    (``""``, a tool without parameters) or absent become ``{}``, as vLLM makes them."""
    if not isinstance(calls, list):
        raise _malformed(f"message {i} (assistant) has 'tool_calls' that is not a list")
    parsed = []
    for k, call in enumerate(calls):
        if not isinstance(call, dict):
            raise _malformed(f"message {i} (assistant): tool call {k} is not an object")
        inner = call.get("function") if isinstance(call.get("function"), dict) else None
        holder = inner if inner is not None else call
        arguments = holder.get("arguments")
        if not arguments:  # "" or none, a tool without parameters: vLLM renders {}
            holder = {**holder, "arguments": {}}
            call = {**call, "function": holder} if inner is not None else holder
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise _malformed(
                    f"message {i} (assistant): tool call {k} has 'arguments' that are not JSON ({e})"
                ) from None
            holder = {**holder, "arguments": arguments}
            call = {**call, "function": holder} if inner is not None else holder
        parsed.append(call)
    return parsed


def _sharegpt_messages(value: Any, system: Any) -> list[dict]:
    if not isinstance(value, list):
        raise _malformed(f"'conversations' is a {type(value).__name__}, not a list")
    # SpecForge's rows: 'conversations' holding OpenAI {role, content} turns, read as 'messages' are.
    if value and all(isinstance(t, dict) and "role" in t and "from" not in t for t in value):
        messages = _chat_messages(value)
    else:
        messages = _from_value_turns(value)
    # A row-level system prompt (LLaMA-Factory's layout) applies unless the conversation opens with its own.
    if isinstance(system, str) and system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _from_value_turns(value: list) -> list[dict]:
    messages = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise _malformed(
                f"conversation turn {i} is neither ShareGPT's {{'from', 'value'}} with a string 'value' nor a "
                "chat message {'role', 'content'}"
            )
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise _malformed(
                f"conversation turn {i} has unknown 'from' {turn.get('from')!r}; "
                f"expected one of {', '.join(SHAREGPT_ROLES)}"
            )
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _tools(value: Any) -> list | None:
    if value is None:
        return None
    if isinstance(value, str):  # some exports store the tool list as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _malformed(f"'tools' is a string but not JSON ({e})") from e
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise _malformed("'tools' must be a list of objects")
    return _drop_nones(value) or None


REASONING_MARK = "hsextract-reasoning-{}-7f3a"

"""What a turn's reasoning is replaced with to see whether the template renders it: text no template rewrites."""


def _unrendered(messages: list[dict], tools: list | None, full: str, render) -> tuple[str, ...]:
    """What the conversation carries that its rendering ``full`` left out, by name: ``reasoning`` (of a reply after
    the last user message: the model wrote it, its tokens leave it out), ``earlier reasoning`` (of a turn before a
    later user message: what Qwen's templates, and so the server, drop), ``tools`` (a template without a tools
    section) and ``stale reasoning_content`` (beside a ``reasoning`` rendered in its place, as vLLM does). Each turn's reasoning is told apart by rendering once more (``render(messages)``) with every reasoning
    replaced by its own mark: a text that appears elsewhere in the conversation is not taken for rendered."""
    reasoned = [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and (m.get("reasoning_content") or "").strip()
    ]
    dropped = []
    if reasoned:
        marked = [
            {**m, "reasoning": REASONING_MARK.format(i), "reasoning_content": REASONING_MARK.format(i)}
            if i in reasoned
            else m
            for i, m in enumerate(messages)
        ]
        try:
            text = render(marked)
            dropped = [i for i in reasoned if REASONING_MARK.format(i) not in text]
        except (
            Exception
        ):  # a template that reads the reasoning's text: what it renders is searched for instead
            dropped = [i for i in reasoned if messages[i]["reasoning_content"].strip() not in full]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    if any(i > last_user for i in dropped):
        out.append("reasoning")
    if any(i < last_user for i in dropped):
        out.append("earlier reasoning")
    if tools and any(_tool_name(t) and _tool_name(t) not in full for t in tools):
        out.append("tools")
    if getattr(messages, "conflicts", 0):
        out.append("stale reasoning_content")
    return tuple(out)


def _tool_name(tool: dict) -> str:
    inner = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = inner.get("name")
    return name if isinstance(name, str) else ""
