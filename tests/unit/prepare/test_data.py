"""Tokenizing rows (prepare/tokenize.py, prepare/chat.py, prepare/rows.py, prepare/tokenfile.py): formats, the bad-row
policy, loss masks under several chat templates, process pools, the token cache.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import numpy as np
import pytest

from hsextract import demo
from hsextract.demo import TOOLS, build_tokenizer, make_conversations, write_jsonl
from hsextract.errors import HsextractError
from hsextract.prepare import tokenfile
from hsextract.prepare import tokenize as data
from hsextract.prepare.rows import data_fingerprint, read_rows
from hsextract.prepare.tokenfile import TokenizedSamples
from hsextract.prepare.tokenize import DataReport, load_samples, tokenizer_fingerprint

WEATHER_CALL = {"function": {"name": "get_weather", "arguments": {"city": "paris"}}}
WEATHER_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """Decoded text of each maximal run of mask == 1; one run per assistant turn unless two turns touch."""
    runs, current = [], []
    for token, bit in zip(ids.tolist(), mask.tolist(), strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [decode(tokenizer, run) for run in runs]


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def load(path, tokenizer, **kwargs) -> tuple[TokenizedSamples, DataReport]:
    kwargs.setdefault("max_length", 4096)
    return load_samples(path, tokenizer, progress=False, **kwargs)


def only_sample(tmp_path, tokenizer, row, name="row.jsonl"):
    samples, report = load(write_jsonl([row], tmp_path / name), tokenizer)
    assert report.kept == 1, report.examples
    return samples.sample(0)


def assert_same_samples(a: TokenizedSamples, b: TokenizedSamples) -> None:
    assert a.sample_ids == b.sample_ids
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    np.testing.assert_array_equal(a.offsets, b.offsets)


AGENT_MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is the weather"},
    {
        "role": "assistant",
        "content": "<think>\nneed the tool\n</think>\n\nlet me check",
        "tool_calls": [WEATHER_CALL],
    },
    {"role": "tool", "content": "sunny and warm"},
    {"role": "assistant", "content": "<think>\nit is sunny\n</think>\n\nIt is sunny."},
    {"role": "user", "content": "and tomorrow"},
    {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "<think>\nrain means umbrella\n</think>\n\nRain, take an umbrella."},
]


def test_chat_mask_covers_exactly_the_assistant_turns(tmp_path, tokenizer):
    ids, mask = only_sample(tmp_path, tokenizer, {"id": "agent", "messages": AGENT_MESSAGES, "tools": TOOLS})

    # The demo template drops <think> from turns before the last user message and keeps it after.
    assert masked_runs(tokenizer, ids, mask) == [
        f"let me check{WEATHER_CALL_TEXT}<|im_end|>",
        "It is sunny.<|im_end|>",
        f"{WEATHER_CALL_TEXT}<|im_end|>",
        "<think>\nrain means umbrella\n</think>\n\nRain, take an umbrella.<|im_end|>",
    ]
    # The ids are exactly what the template renders, tokenized as transformers does it.
    expected = tokenizer.apply_chat_template(AGENT_MESSAGES, tools=TOOLS, tokenize=True)["input_ids"]
    assert ids.tolist() == list(expected)
    unmasked = decode(tokenizer, ids[mask == 0])
    for text in (
        "be brief",
        "what is the weather",
        "sunny and warm",
        "and tomorrow",
        "rain\n",
        "get_weather",
    ):
        assert text in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 4  # headers are never learned
    assert "need the tool" not in decode(tokenizer, ids)


def demo_template_turn(messages: list[dict], i: int) -> str:
    """What the demo template writes for assistant message ``i``, header excluded (a model of CHAT_TEMPLATE)."""
    last_user = max(j for j, m in enumerate(messages) if m["role"] == "user")
    content = messages[i]["content"] or ""
    if i < last_user and "</think>" in content:
        content = content.split("</think>")[-1].lstrip("\n")
    calls = "".join(
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {json.dumps(c["function"]["arguments"])}}}'
        "\n</tool_call>"
        for c in messages[i].get("tool_calls") or []
    )
    return content + calls + "<|im_end|>"


def test_chat_mask_matches_the_template_on_every_demo_conversation(tmp_path, tokenizer):
    rows = make_conversations(300, seed=7)
    samples, report = load(write_jsonl(rows, tmp_path / "demo.jsonl"), tokenizer)

    assert (report.rows, report.kept) == (300, 300)
    assert samples.sample_ids == [row["id"] for row in rows]
    for k, row in enumerate(rows):
        messages = row["messages"]
        expected = [
            demo_template_turn(messages, i) for i, m in enumerate(messages) if m["role"] == "assistant"
        ]
        assert masked_runs(tokenizer, *samples.sample(k)) == expected, row["id"]


def test_sharegpt_rows_mask_like_the_same_chat(tmp_path, tokenizer):
    conversations = [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hello there"},
        {"from": "gpt", "value": "<think>\ngreet back\n</think>\n\nhi"},
        {"from": "user", "value": "what is the weather"},
        {"from": "chatgpt", "value": "sunny"},
    ]
    roles = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}
    messages = [{"role": roles[t["from"]], "content": t["value"]} for t in conversations]

    sharegpt = only_sample(tmp_path, tokenizer, {"conversations": conversations}, "sharegpt.jsonl")
    chat = only_sample(tmp_path, tokenizer, {"messages": messages}, "chat.jsonl")

    np.testing.assert_array_equal(sharegpt[0], chat[0])
    np.testing.assert_array_equal(sharegpt[1], chat[1])
    assert masked_runs(tokenizer, *sharegpt) == ["hi<|im_end|>", "sunny<|im_end|>"]


def test_specforge_conversations_of_role_content_turns_read_like_the_same_chat(tmp_path, tokenizer):
    # SpecForge's own rows: 'conversations' holding chat messages, tool calls and reasoning included.
    specforge = only_sample(
        tmp_path, tokenizer, {"conversations": AGENT_MESSAGES, "tools": TOOLS}, "sf.jsonl"
    )
    chat = only_sample(tmp_path, tokenizer, {"messages": AGENT_MESSAGES, "tools": TOOLS}, "chat.jsonl")
    np.testing.assert_array_equal(specforge[0], chat[0])
    np.testing.assert_array_equal(specforge[1], chat[1])
    assert len(masked_runs(tokenizer, *specforge)) == 4


def test_sharegpt_row_level_system_prompt_is_prepended(tmp_path, tokenizer):
    row = {
        "system": "be brief",
        "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
    }
    ids, mask = only_sample(tmp_path, tokenizer, row)
    assert decode(tokenizer, ids).startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert masked_runs(tokenizer, ids, mask) == ["yo<|im_end|>"]


def test_pretokenized_rows_keep_ids_and_mask_exactly(tmp_path, tokenizer):
    rows = [
        {"id": 7, "input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0]},
        {"input_ids": [10, 11, 12]},
    ]
    samples, report = load(write_jsonl(rows, tmp_path / "pre.jsonl"), tokenizer)

    assert report.kept == 2
    assert samples.sample_ids == ["7", "1"]
    assert samples.sample(0)[0].tolist() == [5, 6, 7, 8, 9]
    assert samples.sample(0)[1].tolist() == [0, 0, 1, 1, 0]
    assert samples.sample(1)[0].tolist() == [10, 11, 12]
    assert samples.sample(1)[1].tolist() == [1, 1, 1]
    assert samples.input_ids.dtype == np.int32 and samples.loss_mask.dtype == np.uint8
    assert samples.lengths.tolist() == [5, 3]


MIXED_ROWS = [
    *make_conversations(12, seed=3),
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"id": "pre", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
]


def write_all_formats(rows: list[dict], root) -> dict:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    # Column-wise so that Arrow takes the union of the keys of all rows, not those of the first one.
    columns = {key: [row.get(key) for row in rows] for key in sorted({k for row in rows for k in row})}
    paths = {"jsonl": write_jsonl(rows, root / "rows.jsonl"), "json": root / "rows.json"}
    paths["json"].write_text(json.dumps(rows))
    paths["json_data"] = root / "wrapped.json"
    paths["json_data"].write_text(json.dumps({"data": rows}))
    paths["parquet"] = root / "rows.parquet"
    pq.write_table(pa.Table.from_pydict(columns), paths["parquet"])
    paths["dataset"] = root / "dataset"
    datasets.Dataset.from_dict(columns).save_to_disk(str(paths["dataset"]))
    paths["dataset_dict"] = root / "dataset_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns)}).save_to_disk(
        str(paths["dataset_dict"])
    )
    return paths


def test_every_input_format_gives_identical_samples(tmp_path, tokenizer):
    paths = write_all_formats(MIXED_ROWS, tmp_path)

    results = {name: load(path, tokenizer) for name, path in paths.items()}

    reference, report = results["jsonl"]
    assert report.kept == len(MIXED_ROWS)
    assert reference.sample_ids[-2:] == ["12", "pre"]
    for name, (samples, other_report) in results.items():
        assert_same_samples(samples, reference), name
        assert counts_only(other_report) == counts_only(report), name
        assert other_report.sources[0]["identity"]["hash"], name
    assert len(list(read_rows(paths["parquet"]))) == len(MIXED_ROWS)


def counts_only(report: DataReport) -> DataReport:
    """The report without what names the source (its path, kind and identity)."""
    keep = ("rows", "kept", "truncated", "skipped_empty", "skipped_malformed", "skipped_too_long", "tokens")
    return dataclasses.replace(report, sources=[{k: s[k] for k in keep} for s in report.sources])


def test_dataset_dict_without_train_split_is_an_error(tmp_path):
    import datasets

    split = datasets.Dataset.from_dict({"input_ids": [[1, 2]]})
    datasets.DatasetDict({"a": split, "b": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(HsextractError, match=r"splits \['a', 'b'\] and none is 'train'"):
        list(read_rows(tmp_path / "dd"))


def write_bad_rows(path, long_answer: str):
    good = {
        "id": "good",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    }
    lines = [
        json.dumps(good),
        '{"messages": [{"role": "user", "content": "hi"',  # cut-off JSON
        json.dumps({"id": "nothing", "body": "no usable field"}),
        json.dumps(
            {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "x"}]}
        ),
        json.dumps({"id": "empty", "messages": []}),
        json.dumps(
            {
                "id": "long",
                "messages": [
                    {"role": "user", "content": "go"},
                    {"role": "assistant", "content": long_answer},
                ],
            }
        ),
        json.dumps({"input_ids": [1, 2, 3], "loss_mask": [1, 0]}),
        json.dumps([1, 2, 3]),
        json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
        "",  # a blank line is no row
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"}]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_rows_are_counted_with_examples_when_truncating(tmp_path, tokenizer):
    path = write_bad_rows(tmp_path / "bad.jsonl", " ".join(["word"] * 200))

    samples, report = load(path, tokenizer, max_length=64)

    assert (report.rows, report.kept, report.truncated) == (10, 3, 1)
    assert (report.skipped_malformed, report.skipped_empty, report.skipped_too_long) == (5, 2, 0)
    assert samples.sample_ids == ["good", "long", "9"]
    assert samples.lengths[1] == 64 and report.tokens == int(samples.lengths.sum())
    reasons = {e["row"]: (e["id"], e["kind"], e["reason"]) for e in report.examples}
    assert reasons[1][:2] == ("1", "malformed") and "line 2 is not valid JSON" in reasons[1][2]
    assert reasons[2][:2] == ("nothing", "malformed") and "none of the fields" in reasons[2][2]
    assert reasons[3][1] == "malformed" and "unknown role 'robot'" in reasons[3][2]
    assert reasons[4][:2] == ("empty", "empty") and "no messages" in reasons[4][2]
    assert reasons[5][:2] == ("long", "truncated") and "cut to 64" in reasons[5][2]
    assert reasons[6][1] == "malformed" and "'loss_mask' has 2 entries for 3" in reasons[6][2]
    assert reasons[7][1] == "malformed" and "not an object" in reasons[7][2]
    assert reasons[8][1] == "empty" and "no assistant message" in reasons[8][2]
    assert 0 not in reasons and 9 not in reasons
    assert report.summary() == (
        f"10 rows: 3 kept (1 truncated to 64 tokens), 2 empty, 5 malformed; {report.tokens} tokens"
    )
    assert DataReport.from_json(json.loads(json.dumps(report.to_json()))) == report


def test_a_deeply_nested_row_is_malformed_and_a_fifo_is_refused(tmp_path, tokenizer):
    """A row nested 100000 deep raised RecursionError; a FIFO was read twice, the second time empty, and hung."""
    import os

    path = tmp_path / "nested.jsonl"
    good = {"id": "good", "input_ids": [5, 6, 7], "loss_mask": [1, 1, 1]}
    path.write_text(json.dumps(good) + "\n" + "[" * 100000 + "]" * 100000 + "\n")
    samples, report = load(path, tokenizer, max_length=64)
    assert samples.sample_ids == ["good"] and report.skipped_malformed == 1
    assert "line 2 nests too deeply to be a row" in report.examples[0]["reason"]
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(HsextractError, match="is not a regular file"):
        load(fifo, tokenizer, max_length=64)


def test_too_long_rows_are_skipped_under_the_skip_policy(tmp_path, tokenizer):
    path = write_bad_rows(tmp_path / "bad.jsonl", " ".join(["word"] * 200))

    samples, report = load(path, tokenizer, max_length=64, too_long="skip")

    assert (report.kept, report.truncated, report.skipped_too_long) == (2, 0, 1)
    assert samples.sample_ids == ["good", "9"]
    [example] = [e for e in report.examples if e["kind"] == "too_long"]
    assert example["id"] == "long" and "> max_length 64" in example["reason"]
    assert "1 longer than 64 tokens skipped" in report.summary()


def test_truncation_that_leaves_no_assistant_token_skips_the_row_as_empty(tmp_path, tokenizer):
    row = {"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl([row, {"input_ids": [1, 2]}], tmp_path / "r.jsonl")

    samples, report = load(path, tokenizer, max_length=16)

    assert (report.kept, report.skipped_empty, report.truncated) == (1, 1, 0)
    assert "no assistant tokens in the first 16" in report.examples[0]["reason"]


def test_out_of_vocabulary_ids_and_bad_masks_are_malformed(tmp_path, tokenizer):
    rows = [
        {"input_ids": [1, len(tokenizer)]},
        {"input_ids": [1, 2], "loss_mask": [0, 2]},
        {"input_ids": [1.5, 2]},
        {"input_ids": [[1, 2], [3]]},
        {"input_ids": []},
        {"input_ids": [1, 2]},
    ]
    _, report = load(write_jsonl(rows, tmp_path / "r.jsonl"), tokenizer)
    assert (report.kept, report.skipped_malformed, report.skipped_empty) == (1, 4, 1)
    assert "outside the tokenizer's range" in report.examples[0]["reason"]


def test_bad_arguments_and_unusable_data_raise_clear_errors(tmp_path, tokenizer):
    good = write_jsonl([{"input_ids": [1, 2]}], tmp_path / "good.jsonl")
    with pytest.raises(HsextractError, match=r"too_long must be one of truncate, skip, got 'drop'"):
        load(good, tokenizer, too_long="drop")
    with pytest.raises(HsextractError, match=r"max_length must be a positive integer, got 0"):
        load(good, tokenizer, max_length=0)
    with pytest.raises(
        HsextractError, match=r"missing\.jsonl does not exist: give a \.jsonl \(or \.jsonl\.gz"
    ):
        load(tmp_path / "missing.jsonl", tokenizer)
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(HsextractError, match=r"rows\.csv: unknown format '\.csv'; give a \.jsonl"):
        load(tmp_path / "rows.csv", tokenizer)
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(HsextractError, match=r"cannot parse .*broken\.json as JSON"):
        load(tmp_path / "broken.json", tokenizer)

    all_bad = tmp_path / "all_bad.jsonl"
    all_bad.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(HsextractError) as error:
        load(all_bad, tokenizer)
    message = str(error.value)
    assert "no usable samples in" in message and "2 rows: 0 kept, 1 empty, 1 malformed" in message
    assert "row 1 (malformed): line 2 is not valid JSON" in message


@pytest.mark.slow
def test_num_proc_2_matches_num_proc_1_and_a_ctrl_c_reaches_the_parent_alone(
    tmp_path, tokenizer, monkeypatch
):
    """The pool gives what one process gives. Its processes start with SIGINT blocked (inherited across their
    exec, so it holds while they read their start-up data) and ignore it from their initializer on: the
    terminal's Ctrl-C, sent to the whole process group, does nothing there and the pool still gives every chunk
    (was: a child still reading printed an UnpicklingError); the parent's own handler is back once they are
    started."""
    import multiprocessing
    import os
    import signal

    rows = [*make_conversations(300, seed=11), *MIXED_ROWS[-2:], {"messages": "oops"}]
    path = write_jsonl(rows, tmp_path / "rows.jsonl")
    serial, serial_report = load(path, tokenizer, max_length=128)

    interrupted, chunks = [], data._chunks

    def interrupting(rows, size):
        for i, chunk in enumerate(chunks(rows, size)):
            if i == 1:  # the pool is up: its first chunk went out
                for child in multiprocessing.active_children():
                    status = dict(
                        line.split(":", 1) for line in open(f"/proc/{child.pid}/status").read().splitlines()
                    )
                    held = int(status["SigIgn"], 16) | int(
                        status["SigBlk"], 16
                    )  # ignored, or blocked until then
                    assert held & (1 << (signal.SIGINT - 1)), f"{child.pid} would take a Ctrl-C"
                    os.kill(child.pid, signal.SIGINT)
                    interrupted.append(child.pid)
            yield chunk

    monkeypatch.setattr(data, "_chunks", interrupting)
    handler = signal.getsignal(signal.SIGINT)
    parallel, parallel_report = load(path, tokenizer, max_length=128, num_proc=2)
    assert len(interrupted) == 2 and signal.getsignal(signal.SIGINT) is handler

    assert_same_samples(parallel, serial)
    assert parallel_report == serial_report
    assert serial_report.truncated > 0 and serial_report.skipped_malformed == 1


def test_cache_is_reused_for_the_same_inputs_only(tmp_path, tokenizer, monkeypatch):
    path = write_jsonl(MIXED_ROWS, tmp_path / "rows.jsonl")
    cache = tmp_path / "cache"
    first, first_report = load(path, tokenizer, cache_dir=cache)
    [cache_file] = cache.glob("tokens-*.safetensors")

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again instead of loading the cache")

    with monkeypatch.context() as patch:
        patch.setattr(data, "_tokenize", no_tokenizing)
        second, second_report = load(path, tokenizer, cache_dir=cache)
    assert_same_samples(second, first)
    assert second_report == first_report

    load(path, tokenizer, cache_dir=cache, max_length=32)
    other_template = copy.deepcopy(tokenizer)
    other_template.chat_template = tokenizer.chat_template + " "
    load(path, tokenizer=other_template, cache_dir=cache)
    assert len(list(cache.glob("tokens-*.safetensors"))) == 3

    cache_file.unlink()  # a new file: `first` maps the old one, and hsextract never writes a token file in place
    cache_file.write_bytes(b"garbage")
    third, _ = load(path, tokenizer, cache_dir=cache)  # an unreadable cache is rebuilt, not fatal
    assert_same_samples(third, first)
    assert TokenizedSamples.load(cache_file).sample_ids == first.sample_ids


def test_tokenized_samples_round_trip_through_one_file(tmp_path):
    samples = TokenizedSamples(
        sample_ids=["a", "b"], input_ids=[1, 2, 3], loss_mask=[0, 1, 1], offsets=[0, 1, 3]
    )
    path = samples.save(tmp_path / "s.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]
    loaded = TokenizedSamples.load(path)
    assert_same_samples(loaded, samples)
    assert len(loaded) == 2 and loaded.sample(1)[0].tolist() == [2, 3]
    with pytest.raises(IndexError):
        loaded.sample(2)
    with pytest.raises(ValueError, match="offsets"):
        TokenizedSamples(sample_ids=["a"], input_ids=[1, 2], loss_mask=[1, 1], offsets=[0, 1])


def test_fingerprints_follow_content_not_names(tmp_path, tokenizer):
    a = write_jsonl(MIXED_ROWS, tmp_path / "a.jsonl")
    b = write_jsonl(MIXED_ROWS, tmp_path / "b.jsonl")
    c = write_jsonl(MIXED_ROWS[:-1], tmp_path / "c.jsonl")
    assert data_fingerprint(a) == data_fingerprint(b) != data_fingerprint(c)
    paths = write_all_formats(MIXED_ROWS[:3], tmp_path / "formats")
    assert data_fingerprint(paths["dataset"]) == data_fingerprint(paths["dataset"])

    other = copy.deepcopy(tokenizer)
    other.chat_template = "{{ messages[0].content }}"
    assert (
        tokenizer_fingerprint(other)["tokenizer_hash"] == tokenizer_fingerprint(tokenizer)["tokenizer_hash"]
    )
    assert (
        tokenizer_fingerprint(other)["chat_template_hash"]
        != tokenizer_fingerprint(tokenizer)["chat_template_hash"]
    )
    grown = copy.deepcopy(other)  # carries the hash kept on `other`: a token added after loading changes it
    grown.add_tokens(["<|grown|>"])
    assert tokenizer_fingerprint(grown)["tokenizer_hash"] != tokenizer_fingerprint(other)["tokenizer_hash"]


LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Mistral-style: no assistant header at all, the system prompt folded into the first user turn, and reasoning
# dropped from every assistant turn but the final message (a history rewrite with nothing to anchor on).
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set system = messages[0].content + '\n\n' if messages[0].role == 'system' else '' %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST] {{ system if loop.index0 <= 1 else '' }}{{ m.content }} [/INST]"
    "{%- elif m.role == 'assistant' %}"
    "{%- set c = m.content %}"
    "{%- if not loop.last and '</think>' in c %}{%- set c = c.split('</think>')[-1] | trim %}{%- endif %}"
    "{{ c }}</s>"
    "{%- endif %}"
    "{%- endfor %}"
)


def with_template(tokenizer, template: str, special_tokens: list[str], bos: str):
    other = copy.deepcopy(tokenizer)
    other.add_tokens(special_tokens, special_tokens=True)
    other.bos_token = bos
    other.chat_template = template
    return other


def test_llama3_style_template_gets_the_same_kind_of_mask(tmp_path, tokenizer):
    llama = with_template(
        tokenizer,
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
    )
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is the weather"},
        {"role": "assistant", "content": "  <think>\nlook\n</think>\n\nchecking "},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ]

    ids, mask = only_sample(tmp_path, llama, {"messages": messages})

    assert masked_runs(llama, ids, mask) == [
        "<think>\nlook\n</think>\n\nchecking<|eot_id|>",
        "It is sunny.<|eot_id|>",
        "You are welcome.<|eot_id|>",
    ]
    unmasked = decode(llama, ids[mask == 0])
    assert unmasked.count("<|start_header_id|>assistant<|end_header_id|>\n\n") == 3
    assert all(text in unmasked for text in ("be brief", "what is the weather", "sunny", "thanks"))


def test_mistral_style_template_without_header_and_with_rewrites(tmp_path, tokenizer):
    mistral = with_template(tokenizer, MISTRAL_TEMPLATE, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nhi there"},
        {"role": "assistant", "content": "<think>\nadd more\n</think>\n\nhow can I help"},
        {"role": "user", "content": "weather"},
        {"role": "assistant", "content": "<think>\nguess\n</think>\n\nsunny"},
    ]

    ids, mask = only_sample(tmp_path, mistral, {"messages": messages})

    # The two consecutive assistant turns touch, so their masked tokens form one run.
    assert masked_runs(mistral, ids, mask) == [
        "hi there</s>how can I help</s>",
        "<think>\nguess\n</think>\n\nsunny</s>",
    ]
    assert decode(mistral, ids[mask == 0]) == "<s>[INST] be brief\n\nhello [/INST][INST] weather [/INST]"


# Qwen3's chat template (tokenizer_config.json of the Qwen3 models) with {% generation %} tags added around what
# the assistant writes, so that transformers' return_assistant_tokens_mask gives an independent expected mask.
# It rewrites history in three ways: reasoning dropped before the last query, an empty <think></think> added to
# the final turn, and consecutive tool results merged into one user turn.
QWEN3_TEMPLATE_WITH_GENERATION_TAGS = "\n".join(
    [
        "{%- if tools %}",
        "    {{- '<|im_start|>system\\n' }}",
        "    {%- if messages[0].role == 'system' %}",
        "        {{- messages[0].content + '\\n\\n' }}",
        "    {%- endif %}",
        '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}',
        "    {%- for tool in tools %}",
        '        {{- "\\n" }}',
        "        {{- tool | tojson }}",
        "    {%- endfor %}",
        '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}',
        "{%- else %}",
        "    {%- if messages[0].role == 'system' %}",
        "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}",
        "    {%- endif %}",
        "{%- endif %}",
        "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}",
        "{%- for message in messages[::-1] %}",
        "    {%- set index = (messages|length - 1) - loop.index0 %}",
        "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}",
        "        {%- set ns.multi_step_tool = false %}",
        "        {%- set ns.last_query_index = index %}",
        "    {%- endif %}",
        "{%- endfor %}",
        "{%- for message in messages %}",
        "    {%- if message.content is string %}",
        "        {%- set content = message.content %}",
        "    {%- else %}",
        "        {%- set content = '' %}",
        "    {%- endif %}",
        '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}',
        "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}",
        '    {%- elif message.role == "assistant" %}',
        "        {%- set reasoning_content = '' %}",
        "        {%- if message.reasoning_content is string %}",
        "            {%- set reasoning_content = message.reasoning_content %}",
        "        {%- else %}",
        "            {%- if '</think>' in content %}",
        "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}",
        "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}",
        "            {%- endif %}",
        "        {%- endif %}",
        "        {{- '<|im_start|>' + message.role + '\\n' }}{% generation %}",
        "        {%- if loop.index0 > ns.last_query_index %}",
        "            {%- if loop.last or (not loop.last and reasoning_content) %}",
        "                {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}",
        "            {%- else %}",
        "                {{- content }}",
        "            {%- endif %}",
        "        {%- else %}",
        "            {{- content }}",
        "        {%- endif %}",
        "        {%- if message.tool_calls %}",
        "            {%- for tool_call in message.tool_calls %}",
        "                {%- if (loop.first and content) or (not loop.first) %}",
        "                    {{- '\\n' }}",
        "                {%- endif %}",
        "                {%- if tool_call.function %}",
        "                    {%- set tool_call = tool_call.function %}",
        "                {%- endif %}",
        '                {{- \'<tool_call>\\n{"name": "\' }}',
        "                {{- tool_call.name }}",
        '                {{- \'", "arguments": \' }}',
        "                {%- if tool_call.arguments is string %}",
        "                    {{- tool_call.arguments }}",
        "                {%- else %}",
        "                    {{- tool_call.arguments | tojson }}",
        "                {%- endif %}",
        "                {{- '}\\n</tool_call>' }}",
        "            {%- endfor %}",
        "        {%- endif %}",
        "        {{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}",
        '    {%- elif message.role == "tool" %}',
        '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}',
        "            {{- '<|im_start|>user' }}",
        "        {%- endif %}",
        "        {{- '\\n<tool_response>\\n' }}",
        "        {{- content }}",
        "        {{- '\\n</tool_response>' }}",
        '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}',
        "            {{- '<|im_end|>\\n' }}",
        "        {%- endif %}",
        "    {%- endif %}",
        "{%- endfor %}",
        "{%- if add_generation_prompt %}",
        "    {{- '<|im_start|>assistant\\n' }}",
        "    {%- if enable_thinking is defined and enable_thinking is false %}",
        "        {{- '<think>\\n\\n</think>\\n\\n' }}",
        "    {%- endif %}",
        "{%- endif %}",
    ]
)


def varied_conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = make_conversations(n, seed=seed)
    for row in rows:
        messages = row["messages"]
        for m in messages:
            if m["role"] == "assistant" and rng.random() < 0.3:
                m["content"] += rng.choice(["\n", "  ", "</think>tail"])
            if m["role"] == "assistant" and rng.random() < 0.15 and "</think>" not in m["content"]:
                m["reasoning_content"] = "reasoning kept apart"
        calls = [i for i, m in enumerate(messages) if m.get("tool_calls")]
        if calls and rng.random() < 0.5:  # two calls answered by two consecutive tool results
            messages[calls[0]]["tool_calls"] *= 2
            messages.insert(calls[0] + 2, {"role": "tool", "content": "second result"})
    return rows


@pytest.mark.parametrize("template", ["demo", "qwen3"])
def test_mask_agrees_with_generation_tags_of_the_template(tmp_path, tokenizer, template):
    if template == "demo":
        tagged = demo.CHAT_TEMPLATE.replace(
            "<|im_start|>assistant\n{{ content }}", "<|im_start|>assistant\n{% generation %}{{ content }}"
        ).replace("{%- endfor -%}<|im_end|>", "{%- endfor -%}<|im_end|>{% endgeneration %}")
    else:
        tagged = QWEN3_TEMPLATE_WITH_GENERATION_TAGS
    assert tagged.count("generation %}") == 2
    oracle, plain = copy.deepcopy(tokenizer), copy.deepcopy(tokenizer)
    oracle.chat_template = tagged
    plain.chat_template = tagged.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    rows = varied_conversations(200, seed=5)

    samples, report = load(write_jsonl(rows, tmp_path / "rows.jsonl"), plain)

    assert report.kept == len(rows)
    for k, row in enumerate(rows):
        expected = oracle.apply_chat_template(
            row["messages"], tools=row.get("tools"), return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = samples.sample(k)
        assert ids.tolist() == list(expected["input_ids"]), row["id"]
        assert mask.tolist() == list(expected["assistant_masks"]), row["id"]


def test_tokenizer_without_chat_template_marks_chat_rows_malformed(tmp_path, tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    with pytest.raises(HsextractError, match="the tokenizer has no chat template.*--chat-template FILE"):
        load(write_jsonl(rows, tmp_path / "r.jsonl"), bare)


def _write_gz_shards(rows: list[dict], folder, shards: int) -> None:
    import gzip

    folder.mkdir(parents=True)
    for k in range(shards):
        with gzip.open(folder / f"part-{k:03d}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows[k::shards])


@pytest.mark.slow  # starts a pool of tokenizer processes
def test_streamed_pool_gives_each_row_its_own_encoding_and_the_plan_of_those_lengths(tmp_path, tokenizer):
    """Two sources of .jsonl.gz shards, tokenized by a pool in small chunks into the token cache: the tokens are
    each row's own encoding (ids as ``apply_chat_template`` gives them), in source order, duplicates dropped."""
    from hsextract.prepare.chat import RowEncoder
    from hsextract.prepare.plan import make_plan
    from hsextract.prepare.sources import resolve_sources

    rng = random.Random(5)
    chat = make_conversations(220, seed=21)
    chat.insert(40, {"messages": "oops"})
    chat.insert(90, dict(chat[10]))  # a duplicate of an earlier row (dedupe drops it, mid-chunk)
    sharegpt = [
        {
            "id": f"s{i}",
            "conversations": [
                {
                    "from": "human",
                    "value": " ".join(rng.choice(["why", "how", "tell", "me"]) for _ in range(9)),
                },
                {
                    "from": "gpt",
                    "value": " ".join(rng.choice(["because", "so", "it", "is"]) for _ in range(40)),
                },
            ],
        }
        for i in range(150)
    ]
    _write_gz_shards(chat, tmp_path / "chat", 3)
    _write_gz_shards(sharegpt, tmp_path / "share", 2)
    data_specs = [str(tmp_path / "chat" / "*.jsonl.gz"), str(tmp_path / "share" / "*.jsonl.gz")]
    mix = resolve_sources(data_specs)

    encoder = RowEncoder(tokenizer, 256, "truncate")
    want_ids, want_ids_list, want_masks, seen = [], [], [], set()
    for source, position, row in mix.rows():
        _, row_id, _, _, ids, mask = encoder.encode(position, row)
        if ids is None or tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        want_ids.append(mix.sample_id(source, row_id))
        want_ids_list.append(np.asarray(ids))
        want_masks.append(np.asarray(mask))
        messages = row.get("messages") or [
            {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
            for t in row["conversations"]
        ]
        rendered = tokenizer.apply_chat_template(messages, tools=row.get("tools"), tokenize=True)
        rendered = rendered if isinstance(rendered, list) else rendered["input_ids"]
        assert list(ids) == list(rendered)[:256]

    cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data, "CHUNK_ROWS", 7)
        patch.setattr(data, "CHUNKS_IN_FLIGHT", 1)
        got, report = load(mix, tokenizer, max_length=256, num_proc=2, cache_dir=cache, dedupe=True)
    again, _ = load(mix, tokenizer, max_length=256, num_proc=1, cache_dir=cache, dedupe=True)

    assert report.skipped_duplicate == 1 and report.skipped_malformed == 1
    for samples in (got, again):
        assert samples.sample_ids == want_ids
        np.testing.assert_array_equal(samples.input_ids, np.concatenate(want_ids_list))
        np.testing.assert_array_equal(samples.loss_mask, np.concatenate(want_masks))
    want_plan = make_plan([len(i) for i in want_ids_list], max_tokens_per_batch=1024, max_rows=16, shards=2)
    got_plan = make_plan(got.lengths.tolist(), max_tokens_per_batch=1024, max_rows=16, shards=2)
    assert got_plan == want_plan and got_plan.plan_hash == want_plan.plan_hash
    assert [p.name for p in cache.iterdir()] == [got.file.name]  # one file, no leftovers


def test_token_file_header_longer_than_its_reserve_moves_the_data_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenfile, "HEADER_RESERVE", 64)
    samples = TokenizedSamples(
        sample_ids=["a", "b"], input_ids=[1, 2, 3], loss_mask=[0, 1, 1], offsets=[0, 1, 3]
    )
    path = samples._save(tmp_path / "s.safetensors", {"data_report": "x" * 500})
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]
    loaded, metadata = TokenizedSamples._load(path)
    assert_same_samples(loaded, samples)
    assert metadata["data_report"] == "x" * 500


def test_a_sample_is_the_first_rows_of_each_source_in_proportion_or_the_cache_when_there(tmp_path, tokenizer):
    from hsextract.prepare.sources import resolve_sources

    _write_gz_shards(make_conversations(300, seed=2), tmp_path / "big", 2)
    _write_gz_shards(make_conversations(100, seed=3), tmp_path / "small", 1)
    mix = resolve_sources([str(tmp_path / "big" / "*.jsonl.gz"), str(tmp_path / "small" / "*.jsonl.gz")])
    whole, _ = load(mix, tokenizer, max_length=256)

    sampled = data.load_sample(mix, tokenizer, max_length=256, rows=40, cache_dir=tmp_path / "cache")
    assert (sampled.rows_sampled, sampled.rows_total, sampled.scale, sampled.basis) == (
        40,
        400,
        10.0,
        "sample",
    )
    big = [s for s in whole.sample_ids if s.startswith("big/")]
    small = [s for s in whole.sample_ids if s.startswith("small/")]
    assert sampled.samples.sample_ids == big[:30] + small[:10]
    assert not (tmp_path / "cache").exists()  # a sample is never cached as the data's tokens

    load(mix, tokenizer, max_length=256, cache_dir=tmp_path / "cache")
    cached = data.load_sample(mix, tokenizer, max_length=256, rows=40, cache_dir=tmp_path / "cache")
    assert (cached.rows_sampled, cached.rows_total, cached.basis) == (400, 400, "token cache")
    assert_same_samples(cached.samples, whole)
