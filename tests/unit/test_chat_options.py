"""``--chat-template`` and ``--chat-template-kwargs`` as RunConfig and regenerate take them: one parser, one line
for each mistake, canonical JSON kept (what the plan records)."""

import datetime

import pytest

from hsextract.config import RunConfig
from hsextract.errors import HsextractError


def config(tmp_path, **options) -> RunConfig:
    return RunConfig(
        model=str(tmp_path),
        data="d.jsonl",
        output=str(tmp_path / "o"),
        run_dir=str(tmp_path / "r"),
        **options,
    )


def test_arguments_are_kept_as_canonical_json_from_the_command_line_or_a_yaml_mapping(tmp_path):
    given = config(tmp_path, chat_template_kwargs='{"preserve_thinking": true, "enable_thinking": false}')
    mapping = config(tmp_path, chat_template_kwargs={"enable_thinking": False, "preserve_thinking": True})
    assert given.chat_template_kwargs == mapping.chat_template_kwargs
    assert given.chat_template_kwargs == '{"enable_thinking": false, "preserve_thinking": true}'
    assert given.template_kwargs == {"enable_thinking": False, "preserve_thinking": True}
    assert config(tmp_path).template_kwargs == {}


@pytest.mark.parametrize(
    "value, says",
    [
        ("{enable_thinking: false}", "is not JSON"),
        ("[1, 2]", "must be a JSON object of template arguments"),
        ('{"add_generation_prompt": true}', "add_generation_prompt is set by each rendering itself"),
        # what vLLM refuses too: accepted, it made every rendering return ids and every row fail
        ('{"tokenize": true}', "tokenize is set by each rendering itself"),
        (
            '{"return_dict": true, "continue_final_message": true}',
            "continue_final_message, return_dict are set",
        ),
        ("[" * 30_000 + "]" * 30_000, "nests deeper than 32 levels"),  # was a RecursionError
        ('{"a": ' + "[" * 40 + "]" * 40 + "}", "nests deeper than 32 levels"),
        ('{"x": NaN}', "nan at x is a float, not a JSON value"),
        (
            {"when": datetime.date(2024, 1, 2)},
            "datetime.date(2024, 1, 2) at when is a date, not a JSON value",
        ),
        ({"enable_thinking": True, 1: "a"}, "the key 1 is a int, not a string"),  # was a TypeError
        ({"deep": {"list": [{2: "b"}]}}, "the key 2 at deep.list[0] is a int"),
        ({"deep": {"x": {1, 2}}}, "at deep.x is a set, not a JSON value"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_option(tmp_path, value, says):
    with pytest.raises(HsextractError, match="--chat-template-kwargs") as e:
        config(tmp_path, chat_template_kwargs=value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_template_is_a_file_or_the_template_itself(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert config(tmp_path, chat_template=str(tmp_path / "t.jinja")).chat_template_text == "{{ messages }}"
    assert config(
        tmp_path, chat_template="{% for m in messages %}{% endfor %}"
    ).chat_template_text.startswith("{%")
    with pytest.raises(HsextractError, match="--chat-template missing.jinja: no such file"):
        config(tmp_path, chat_template="missing.jinja")
