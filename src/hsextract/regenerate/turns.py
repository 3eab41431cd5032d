"""One input row -> the requests it needs and the row it becomes.

Request k holds the row's prompts 0..k with the regenerated replies between them, so that a turn answers the
model's own earlier turns; the dataset's assistant turns are never sent. A conversation stops before its first
tool message, or after a regenerated tool call while prompts remain (a tool result answers the dataset's call).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hsextract.prepare.chat import UnreadableRow, _chat_messages, _RowSkipped, _sharegpt_messages, _tools

SENT_REPLY_KEYS = ("role", "content", "reasoning_content", "reasoning", "tool_calls")
"""What of a reply goes back to the server in the next request (the rest, e.g. ``refusal``, is response-only)."""


class RowSkipped(Exception):
    """A row with nothing to regenerate: ``kind`` is ``malformed``, ``not_chat`` or ``no_prompt``."""

    def __init__(self, kind: str, reason: str, sample_id: str = ""):
        super().__init__(reason)
        self.kind, self.reason, self.sample_id = kind, reason, sample_id

    def __reduce__(self):  # crosses process boundaries with its fields
        return type(self), (self.kind, self.reason, self.sample_id)


@dataclass(frozen=True)
class Conversation:
    """What one row asks of the servers."""

    sample_id: str
    source: int
    prompts: tuple[tuple[dict, ...], ...]
    """The messages before each turn to regenerate, in order (system and user only)."""
    tools: list | None
    cut_at_tool: bool
    """The dataset's conversation went on past a tool result: it is regenerated up to there."""

    def request_messages(self, replies: list[dict]) -> list[dict]:
        """The messages of the request for turn ``len(replies)``: the prompts with the replies so far between."""
        messages: list[dict] = []
        for prompt, reply in zip(self.prompts, replies, strict=False):
            messages += prompt
            messages.append(sent_reply(reply))
        messages += self.prompts[len(replies)]
        return messages

    def output_row(self, replies: list[dict]) -> dict:
        """The row written: the prompts and the replies as the server returned them, each with its
        ``finish_reason``; ``tools`` as the row gave them. ``hsextract run`` reads it as a chat row."""
        messages: list[dict] = []
        for prompt, reply in zip(self.prompts, replies, strict=False):
            messages += prompt
            messages.append(reply)
        row: dict[str, Any] = {"id": self.sample_id, "messages": messages}
        if self.tools:
            row["tools"] = self.tools
        return row

    def prompt_key(self) -> str:
        """Identifies what the requests depend on (prompts and tools), for ``--dedupe``."""
        text = json.dumps([self.prompts, self.tools], sort_keys=True, ensure_ascii=False)
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def sent_reply(reply: dict) -> dict:
    """A stored reply as the next request carries it: the message fields the server returned, without nulls."""
    return {k: reply[k] for k in SENT_REPLY_KEYS if reply.get(k) is not None and reply.get(k) != []}


def conversation(sample_id: str, source: int, row: Any, turns: str) -> Conversation:
    """The conversation of a row as ``run`` reads it; ``RowSkipped`` when it has nothing to regenerate."""
    if isinstance(row, UnreadableRow):
        raise RowSkipped("malformed", row.reason)
    if not isinstance(row, dict):
        raise RowSkipped("malformed", f"row is a {type(row).__name__}, not an object")
    try:
        if row.get("messages") is not None:
            messages = _chat_messages(row["messages"])
        elif row.get("conversations") is not None:
            messages = _sharegpt_messages(row["conversations"], row.get("system"))
        elif row.get("input_ids") is not None or row.get("text") is not None:
            raise RowSkipped("not_chat", "a text or token row has no prompts to answer")
        else:
            raise RowSkipped("malformed", "row has none of the fields 'messages', 'conversations'")
        tools = _tools(row.get("tools"))
    except _RowSkipped as e:
        raise RowSkipped("malformed", e.reason) from None
    prompts, cut = split_prompts(messages, turns)
    if not prompts:
        where = "before its first tool result" if cut else "in it"
        raise RowSkipped("no_prompt", f"no user message to answer {where}")
    return Conversation(sample_id, source, tuple(tuple(p) for p in prompts), tools, cut)


def split_prompts(messages: list[dict], turns: str = "all") -> tuple[list[list[dict]], bool]:
    """The prompts of the turns to regenerate (see the module docstring), and whether a tool message cut the
    conversation short. An assistant message with no user message since the last turn answers nothing: dropped."""
    prompts: list[list[dict]] = []
    current: list[dict] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            return prompts, True
        if role == "assistant":
            if any(m["role"] == "user" for m in current):
                prompts.append(current)
                current = []
                if turns == "first":
                    return prompts, False
            continue
        current.append(_prompt_message(message))
    if any(m["role"] == "user" for m in current):
        prompts.append(current)
    return prompts, False


def _prompt_message(message: dict) -> dict:
    out = {"role": message["role"], "content": message["content"]}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out
