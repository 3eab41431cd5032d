"""What a reply must be to be stored: an assistant message of the model asked for, answering the request it came
back for; else it is retried, then its row counts as failed with the reason (docs/RELIABILITY.md).

The response's ``model`` is pinned per endpoint on its first stored reply, so a server that changes model mid-run is
caught; a response id seen before is a stale copy on the connection (a proxy that wrote an answer twice).
"""

from __future__ import annotations

import json
from collections import deque

SEEN_IDS = 1 << 17

"""Response ids remembered to catch a replayed answer (a stale one arrives on the connection's next request)."""


REPLAYED = "a response id seen before (the connection repeated an answer)"


def message_problem(message: dict) -> str | None:
    """Why ``message`` (choices[0].message) cannot be stored, or None. The words are the failure's cause, so they
    name the kind of problem, not the reply's text."""
    role = message.get("role")
    if role is None:
        return "reply with no role"
    if role != "assistant":
        return f"reply of role {str(role)[:20]!r}, not assistant"
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not (isinstance(tool_calls, list) and all(_is_call(c) for c in tool_calls)):
        return "reply whose tool_calls are not function calls"
    for key in ("content", "reasoning_content", "reasoning"):
        if message.get(key) is not None and not isinstance(message[key], str):
            return f"reply whose {key} is not a string"
    reasoned = any(message.get(k) for k in ("reasoning_content", "reasoning"))
    if message.get("content") is None and not tool_calls and not reasoned:
        return "reply with null content and no tool call or reasoning"
    try:
        json.dumps(message, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return "reply holding half a surrogate pair (not UTF-8)"
    return None


def _is_call(call) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


class Provenance:
    """Whether a response answers this run's request: the model it names (pinned per endpoint) and its id (never
    seen before)."""

    def __init__(self, served_model: str):
        self.served_model = served_model
        self.seen: set[str] = set()
        self.order: deque[str] = deque()

    def problem(self, endpoint, model, response_id) -> str | None:
        """Why a response of ``endpoint`` naming ``model`` and ``response_id`` is not this request's answer."""
        if isinstance(response_id, str) and response_id in self.seen:
            return REPLAYED
        if not isinstance(model, str):
            return "response naming no model"
        if endpoint.answers_as is not None:
            if model != endpoint.answers_as:
                return f"reply of model {model[:80]} (its first replies were {endpoint.answers_as})"
            return None
        asked = self.served_model
        if model != asked and not model.startswith(asked + "@") and model not in (endpoint.listed or ()):
            return f"reply of model {model[:80]}, not {asked}"
        return None

    def accept(self, endpoint, model: str, response_id) -> None:
        """A stored reply's model (pinned for its endpoint) and id (remembered)."""
        if endpoint.answers_as is None:
            endpoint.answers_as = model
        if isinstance(response_id, str):
            self.seen.add(response_id)
            self.order.append(response_id)
            if len(self.order) > SEEN_IDS:
                self.seen.discard(self.order.popleft())
