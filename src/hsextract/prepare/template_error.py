"""A chat template's failure as one line: which template, its line, and the error (Jinja's own words).

A template that raises (``raise_exception``), recurses without end or does not parse fails the rows it renders;
the reason each carries names the template, so that the fix lands on the template, not on the model's tokenizer.
"""

from __future__ import annotations

import traceback

TOKENIZERS_OWN = "the tokenizer's chat template"


JINJA_FILENAMES = ("<template>", "<unknown>")

"""The file name Jinja gives the code of a template compiled from a string, in tracebacks (its lines are the
template's: Jinja rewrites the frames)."""


def template_failure(error: BaseException, name: str | None) -> str:
    """``the chat template t.jinja failed at line 12: TemplateError: No user query found in messages.``;
    ``name``: the template's file or description (None: the tokenizer's own)."""
    line = getattr(error, "lineno", None)  # a syntax error says where
    if line is None:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename in JINJA_FILENAMES]
        line = frames[-1].lineno if frames else None
    where = f" at line {line}" if line else ""
    message = str(getattr(error, "message", None) or error).strip().splitlines()
    shown = message[0][:300] if message else ""
    return f"{name or TOKENIZERS_OWN} failed{where}: {type(error).__name__}: {shown}".rstrip(": ")


def is_template_failure(reason: str) -> bool:
    """Whether a row's skip reason is a template's failure (``template_failure``), not a missing template."""
    return " failed" in reason and reason.startswith(
        ("the chat template ", "the --chat-template text", TOKENIZERS_OWN)
    )
