"""``--chat-template-kwargs``: the arguments every rendering of a conversation gets, as a server's
``chat_template_kwargs``. Checked once, where the option is read: each is one line naming what is wrong, never a
failure of every row later (``tokenize`` accepted, then every rendering returned ids), a ``RecursionError`` (30,000
levels deep) or a ``TypeError`` (a YAML date, an integer key) from the JSON they are recorded as.
"""

from __future__ import annotations

import json
import math

from hsextract.errors import HsextractError

RESERVED_TEMPLATE_ARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt"}
    | {"continue_final_message", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask"}
    | {"padding", "truncation", "max_length", "tokenizer_kwargs"}
)
"""Arguments every rendering (ours, a server's) sets itself, and ``apply_chat_template``'s own parameters, which
never reach the template (vLLM refuses ``tokenize`` and ``chat_template``): a user's value would be overridden or
would change what a rendering returns."""
TEMPLATE_ARGS_MAX_DEPTH = 32
"""How deep template arguments may nest: they are flags and small settings, and Jinja recurses through them."""


def template_kwargs_json(value) -> str | None:
    """``--chat-template-kwargs`` (JSON text, or a YAML mapping) as canonical JSON: what the plan records and a
    server's ``chat_template_kwargs`` takes; anything but an object of arguments left to the user is an error."""
    if value is None:
        return None
    try:
        parsed = value if isinstance(value, dict) else json.loads(value)
    except RecursionError:  # nested past Python's own limit
        raise HsextractError(_too_deep()) from None
    except (TypeError, json.JSONDecodeError) as e:
        raise HsextractError(
            f"--chat-template-kwargs {value!r:.200} is not JSON ({e}); give an object, e.g. "
            """'{"enable_thinking": false}'"""
        ) from None
    if not isinstance(parsed, dict):
        raise HsextractError(
            f"--chat-template-kwargs must be a JSON object of template arguments, got {value!r:.200}"
        )
    _check_json_arguments(parsed)
    reserved = sorted(k for k in parsed if k in RESERVED_TEMPLATE_ARGS)
    if reserved:
        raise HsextractError(
            f"--chat-template-kwargs: {', '.join(reserved)} {'is' if len(reserved) == 1 else 'are'} set by each "
            "rendering itself (apply_chat_template's own parameters, as a server sets them), not a template "
            """argument: give only the template's own, e.g. '{"enable_thinking": false}'"""
        )
    return json.dumps(parsed, sort_keys=True)


def _too_deep() -> str:
    return (
        f"--chat-template-kwargs nests deeper than {TEMPLATE_ARGS_MAX_DEPTH} levels: template arguments are flags "
        "and small settings; give them flat"
    )


JSON_SCALARS = (str, bool, int, float, type(None))


def _check_json_arguments(arguments: dict) -> None:
    """Template arguments hold JSON values only (what a server's request can carry): objects with string keys,
    lists, strings, finite numbers, booleans and null, at most ``TEMPLATE_ARGS_MAX_DEPTH`` deep. Walked without
    recursion, so that no nesting is a RecursionError."""
    stack = [(arguments, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        where = f" at {path}" if path else ""
        if depth > TEMPLATE_ARGS_MAX_DEPTH:
            raise HsextractError(_too_deep())
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise HsextractError(
                        f"--chat-template-kwargs: the key {key!r}{where} is a {type(key).__name__}, not a string: "
                        "JSON objects have string keys (quote it in YAML)"
                    )
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif not isinstance(value, JSON_SCALARS) or (isinstance(value, float) and not math.isfinite(value)):
            raise HsextractError(
                f"--chat-template-kwargs: {value!r:.80}{where} is a {type(value).__name__}, not a JSON value: give "
                "strings, finite numbers, booleans, null, lists and objects (quote a date in YAML)"
            )
