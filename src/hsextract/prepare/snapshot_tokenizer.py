"""A transformers tokenizer as preparation uses it, rebuilt from a snapshot without importing transformers (the
snapshot is taken and checked in tokenizer_record.py).

Importing transformers (and torch) is most of a tokenizer process's start. A snapshot holds what decides the tokens
(the backend's JSON, the chat template, the special tokens) and is kept only when the rebuilt tokenizer agrees with
the loaded one on everything preparation reads.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache, cached_property

KEYS = ("backend", "chat_template", "special_tokens_map")


@cache
def _compiled(template: str):
    """``template`` in the sandboxed environment transformers renders chat templates in (same options, filters,
    globals and ``{% generation %}`` tag)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks it for masks)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = env.from_string(template)
    # Its globals as one dict instead of a ChainMap over the environment's: each render copies them, ~3x faster.
    compiled.globals = dict(compiled.globals)
    return compiled


def _sandbox():
    """transformers' sandbox (``ImmutableSandboxedEnvironment``), with its per-access checks made cheap and
    unchanged: rendering is half of a row's preparation, and most of a render's time went to these checks.

    A verdict on an attribute depends only on the object's type and the attribute's name (the checks are
    ``isinstance`` tests and name lists), so it is kept per pair; a message's fields (``message.content``) are read
    from the dict directly, as the sandbox reads a name that is not one of dict's attributes."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    dict_attributes = frozenset(dir(dict))

    class Sandbox(ImmutableSandboxedEnvironment):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.verdicts: dict[tuple[type, str], bool] = {}

        def is_safe_attribute(self, obj, attr, value):
            key = (type(obj), attr)
            verdict = self.verdicts.get(key)
            if verdict is None:
                verdict = self.verdicts[key] = super().is_safe_attribute(obj, attr, value)
            return verdict

        def getattr(self, obj, attribute):
            if type(obj) is dict and attribute not in dict_attributes:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

    return Sandbox


class SnapshotTokenizer:
    """The tokenizer of a snapshot: the attributes and calls preparation uses, answering as the tokenizer it was
    taken from does."""

    def __init__(self, snapshot: dict):
        self.snapshot = snapshot
        self.chat_template = snapshot["chat_template"]
        self.special_tokens_map = dict(snapshot["special_tokens_map"])

    @cached_property
    def backend_tokenizer(self):
        """Built on first use (~2 CPU-s for a 248k vocabulary): a pool's parent only sends the snapshot on."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.snapshot["backend"])

    def __reduce__(self):
        return SnapshotTokenizer, (self.snapshot,)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        decoder = self.backend_tokenizer.get_added_tokens_decoder()
        return {token.content: i for i, token in sorted(decoder.items(), key=lambda item: item[0])}

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @cached_property
    def _template(self):
        return _compiled(self.chat_template)

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        tokenize=False,
        add_generation_prompt=False,
        chat_template: str | None = None,
        **kwargs,
    ):
        """The rendered text, as ``PreTrainedTokenizerBase.apply_chat_template(..., tokenize=False)`` gives it for
        one conversation of message dicts and tools given as JSON schemas; ``chat_template`` replaces the
        tokenizer's template and ``kwargs`` go to the template, as there."""
        if tokenize:
            raise ValueError("a snapshot tokenizer renders only (tokenize=False)")
        if chat_template is None and self.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        if not conversation:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        template = self._template if chat_template is None else _compiled(chat_template)
        return template.render(
            messages=conversation,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )


def valid_snapshot(value) -> bool:
    """``value`` has the form of a snapshot (its agreement with the tokenizer is the fingerprint's to check)."""
    return (
        isinstance(value, dict)
        and set(value) == set(KEYS)
        and isinstance(value["backend"], str)
        and (value["chat_template"] is None or isinstance(value["chat_template"], str))
        and isinstance(value["special_tokens_map"], dict)
        and all(isinstance(k, str) for k in value["special_tokens_map"])
    )
