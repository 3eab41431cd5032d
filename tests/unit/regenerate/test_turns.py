"""A row -> the requests it needs and the row it becomes (regenerate/turns.py, regenerate/rows.py)."""

import pytest

from hsextract.prepare.sources import resolve_sources
from hsextract.regenerate.rows import select, to_request
from hsextract.regenerate.turns import RowSkipped, conversation, sent_reply, split_prompts

SYSTEM = {"role": "system", "content": "be brief"}


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def test_every_assistant_turn_is_a_request_holding_the_replies_before_it():
    row = {
        "id": "a",
        "messages": [SYSTEM, _user("q1"), _assistant("old 1"), _user("q2"), _assistant("old 2")],
    }
    conv = conversation("a", 0, row, "all")
    assert conv.prompts == ((SYSTEM, _user("q1")), (_user("q2"),))
    first = {"role": "assistant", "content": "new 1", "reasoning_content": "why", "finish_reason": "stop"}
    assert conv.request_messages([]) == [SYSTEM, _user("q1")]
    # The dataset's assistant turns are never sent; the model's own replies are, as returned (no finish_reason).
    assert conv.request_messages([first]) == [
        SYSTEM,
        _user("q1"),
        {"role": "assistant", "content": "new 1", "reasoning_content": "why"},
        _user("q2"),
    ]
    second = {"role": "assistant", "content": "new 2", "tool_calls": None, "finish_reason": "length"}
    assert conv.output_row([first, second]) == {
        "id": "a",
        "messages": [SYSTEM, _user("q1"), first, _user("q2"), second],
    }


def test_first_keeps_the_first_exchange_only():
    messages = [_user("q1"), _assistant("a1"), _user("q2"), _assistant("a2")]
    assert split_prompts(messages, "first") == ([[_user("q1")]], False)


def test_a_prompt_only_row_is_answered_once():
    assert split_prompts([SYSTEM, _user("q")]) == ([[SYSTEM, _user("q")]], False)
    # ...and a conversation ending on a user message gets its last turn answered too.
    assert split_prompts([_user("q1"), _assistant("a1"), _user("q2")]) == (
        [[_user("q1")], [_user("q2")]],
        False,
    )


def test_a_conversation_stops_before_its_first_tool_result():
    call = {"function": {"name": "get_weather", "arguments": {"city": "x"}}}
    messages = [
        _user("q1"),
        _assistant("", tool_calls=[call]),
        {"role": "tool", "content": "sunny"},
        _assistant("it is sunny"),
        _user("q2"),
        _assistant("a2"),
    ]
    assert split_prompts(messages) == ([[_user("q1")]], True)
    with pytest.raises(RowSkipped) as e:
        conversation("t", 0, {"messages": [_user("q"), {"role": "tool", "content": "r"}]}, "all")
    assert e.value.kind == "no_prompt" and "tool result" in e.value.reason


def test_an_assistant_turn_with_nothing_to_answer_is_dropped():
    messages = [SYSTEM, _assistant("hello, how can I help?"), _user("q"), _assistant("a"), _assistant("more")]
    assert split_prompts(messages) == ([[SYSTEM, _user("q")]], False)


@pytest.mark.parametrize(
    "row, kind",
    [
        ({"text": "plain text"}, "not_chat"),
        ({"input_ids": [1, 2]}, "not_chat"),
        ({"messages": "not a list"}, "malformed"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "malformed"),
        ({"other": 1}, "malformed"),
        ({"messages": [SYSTEM]}, "no_prompt"),
        ([1, 2], "malformed"),
    ],
)
def test_rows_with_nothing_to_regenerate_say_why(row, kind):
    with pytest.raises(RowSkipped) as e:
        conversation("x", 0, row, "all")
    assert e.value.kind == kind


def test_sharegpt_rows_and_their_system_prompt():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "system": "sys"}
    conv = conversation("s", 0, row, "all")
    assert conv.prompts == (({"role": "system", "content": "sys"}, _user("q")),)


def test_sent_reply_keeps_the_message_fields_without_nulls():
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c"}],
        "refusal": None,
        "finish_reason": "x",
    }
    assert sent_reply(reply) == {"role": "assistant", "tool_calls": [{"id": "c"}]}
    assert sent_reply({"role": "assistant", "content": "a", "tool_calls": []}) == {
        "role": "assistant",
        "content": "a",
    }


def test_selection_counts_each_kind_and_ids_follow_run(tmp_path):
    import json

    rows = [
        {"id": "r1", "messages": [_user("same"), _assistant("a")]},
        {"id": "r1", "messages": [_user("other"), _assistant("a")]},  # a repeated id: renamed as run does
        {"messages": [_user("same"), _assistant("b")]},  # no id: its position; a duplicate prompt
        {"text": "plain"},
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    mix = resolve_sources([f"{data}?name=chat"])
    chosen = select(mix, "all", dedupe=True, done={"chat/r1"})
    assert chosen.rows == 5 and chosen.done == 1
    assert chosen.todo == {"chat/r1#2"}
    assert dict(chosen.skipped) == {"duplicate": 1, "not_chat": 1, "malformed": 1}
    assert [c.sample_id for c in to_request(mix, "all", True, chosen.todo)] == ["chat/r1#2"]
    without = select(mix, "all", dedupe=False, done=set())
    assert without.todo == {"chat/r1", "chat/r1#2", "chat/2"}
