"""A chat template that raises, recurses or does not parse: each row's reason names the template (its file, or the
tokenizer's own), its line and the error, and a data none of whose rows render is not blamed on the tokenizer."""

import copy

import pytest

from hsextract.config import RunConfig
from hsextract.demo import write_jsonl
from hsextract.errors import HsextractError
from hsextract.prepare.chat import ChatOptions, RowEncoder
from hsextract.prepare.tokenize import load_samples

ROW = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}

TEMPLATES = {
    "raises": (
        "{%- for m in messages %}{{ m.content }}\n{%- endfor %}\n{{ raise_exception('No user query found.') }}",
        "failed at line 3: TemplateError: No user query found.",
    ),
    "syntax": (
        "{{ messages }}\n{% for m in %}\n",
        "failed at line 2: TemplateSyntaxError: Expected an expression",
    ),
    "recurses": (
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}\n{{ f(1) }}",
        "failed at line 1: RecursionError: maximum recursion depth exceeded",
    ),
    "type": ("x\n\n{{ messages[0].content + 1 }}", "failed at line 3: TypeError: can only concatenate str"),
}


@pytest.mark.parametrize("kind", TEMPLATES)
def test_a_failing_template_given_is_named_with_its_line_and_error(tiny_tokenizer, tmp_path, kind):
    text, says = TEMPLATES[kind]
    path = tmp_path / f"{kind}.jinja"
    path.write_text(text)
    cfg = RunConfig(model=str(tmp_path), data="d.jsonl", output="o", run_dir="r", chat_template=str(path))
    encoder = RowEncoder(tiny_tokenizer, 512, "truncate", chat=cfg.chat_options)
    _, _, status, reason, _, _ = encoder.encode(0, ROW)
    assert status == "malformed"
    assert reason.startswith(f"the chat template {path} {says}"), reason


def test_the_tokenizers_own_template_is_named_as_such(tiny_tokenizer, tmp_path):
    tok = copy.copy(tiny_tokenizer)
    tok.chat_template = "{{ bos_token }}\n{{ raise_exception('Conversation roles must alternate.') }}"
    _, _, status, reason, _, _ = RowEncoder(tok, 512, "truncate").encode(0, ROW)
    assert (status, reason) == (
        "malformed",
        "the tokenizer's chat template failed at line 2: TemplateError: Conversation roles must alternate.",
    )
    # the template as --chat-template text
    inline = ChatOptions.of("{{ raise_exception('x') }}", name="the --chat-template text")
    reason = RowEncoder(tiny_tokenizer, 512, "truncate", chat=inline).encode(0, ROW)[3]
    assert reason == "the --chat-template text failed at line 1: TemplateError: x"


def test_no_row_rendering_is_blamed_on_the_template_not_the_tokenizer(tiny_tokenizer, tmp_path):
    data = write_jsonl([ROW, ROW], tmp_path / "rows.jsonl")
    chat = ChatOptions.of("{{ raise_exception('boom') }}", name="the chat template t.jinja")
    with pytest.raises(HsextractError) as e:
        load_samples(str(data), tiny_tokenizer, max_length=512, chat=chat)
    message = str(e.value)
    assert "the chat template t.jinja failed at line 1: TemplateError: boom" in message
    assert "The chat template fails on these rows" in message and "tokenizer's files" not in message
