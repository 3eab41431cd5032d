"""``--chat-template-kwargs``, checked once for ``run`` and ``regenerate``: the arguments every rendering of a
conversation (hsextract's and a server's) passes to the chat template, as canonical JSON."""

from __future__ import annotations

import json

from hsextract.errors import HsextractError

RESERVED_TEMPLATE_ARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "documents", "chat_template"}
)
"""Arguments every rendering (ours, a server's) sets itself: a user's value for them would be overridden."""


def template_kwargs_json(value) -> str | None:
    """``--chat-template-kwargs`` (JSON text, or a YAML mapping) as canonical JSON: what the plan records and a
    server's ``chat_template_kwargs`` takes; anything but an object of arguments left to the user is an error."""
    if value is None:
        return None
    try:
        parsed = value if isinstance(value, dict) else json.loads(value)
    except (TypeError, json.JSONDecodeError) as e:
        raise HsextractError(
            f"--chat-template-kwargs {value!r} is not JSON ({e}); give an object, e.g. "
            """'{"enable_thinking": false}'"""
        ) from None
    if not isinstance(parsed, dict):
        raise HsextractError(
            f"--chat-template-kwargs must be a JSON object of template arguments, got {value!r}"
        )
    reserved = sorted(set(parsed) & RESERVED_TEMPLATE_ARGS)
    if reserved:
        raise HsextractError(
            f"--chat-template-kwargs: {', '.join(reserved)} are set by each rendering itself, not by the user"
        )
    return json.dumps(parsed, sort_keys=True)
