"""``hsextract regenerate`` against a real OpenAI-compatible server: transformers' own ``transformers serve`` over the
tiny qwen3_5 model on the CPU, started once for the module. Faults are planted by a proxy in front of it
(tests/support/chat_servers.py). The replies are checked against the same requests sent by the ``openai`` client,
and the output is extracted by ``hsextract run`` and read back."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.chat_servers import FaultProxy, start_transformers_serve
from support.cli import run_cli

from hsextract.demo import make_conversations, write_jsonl
from hsextract.prepare.rows import read_rows

pytestmark = pytest.mark.slow

MODEL = "hsextract/tiny-qwen3_5"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    server = start_transformers_serve(tiny_model, tmp_path_factory.mktemp("serve"), MODEL)
    yield server
    server.stop()


@pytest.fixture
def proxy(served):
    p = FaultProxy(served.url)
    yield p
    p.stop()


def tagged_rows(n: int, seed: int = 5) -> list[dict]:
    """Demo conversations whose first user message names the row (the proxy's log says which rows it saw)."""
    rows = make_conversations(n, seed=seed)
    for i, row in enumerate(rows):
        first = next(m for m in row["messages"] if m["role"] == "user")
        first["content"] = f"row-{i}: {first['content']}"
    return rows


def prompt_rows(n: int) -> list[dict]:
    return [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"row-{i}: say something"}]}
        for i in range(n)
    ]


def regenerate(urls, data, out, *extra, check=True, env=None):
    args = ["regenerate", "--served-model", MODEL, "--output", out, "--no-progress"]
    for url in urls if isinstance(urls, list) else [urls]:
        args += ["--endpoint", url]
    for d in data if isinstance(data, list) else [data]:
        args += ["--data", d]
    return run_cli(
        *args, "--temperature", "0", "--max-tokens", "5", *extra, check=check, env=env, timeout=240
    )


def written(out: Path) -> list[dict]:
    """Every row of every chunk (each read to its end: a torn chunk raises)."""
    return [row for chunk in sorted(out.glob("chunk-*.jsonl.*")) for row in read_rows(chunk)]


def test_a_mix_is_regenerated_turn_by_turn_and_run_extracts_it(served, tiny_model, tiny_tokenizer, tmp_path):
    from openai import OpenAI

    from hsextract.output import open_output

    chat = tagged_rows(14)
    chat[3]["messages"] = [{"role": "user", "content": "row-3: a prompt with no reply yet"}]
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": f"sg {i} q1"},
                {"from": "gpt", "value": "a1"},
                {"from": "human", "value": f"sg {i} q2"},
                {"from": "gpt", "value": "a2"},
            ],
            "system": "be brief",
        }
        for i in range(3)
    ]
    write_jsonl([*chat, {"text": "plain text has no prompt"}], tmp_path / "chat.jsonl")
    write_jsonl(sharegpt, tmp_path / "sg.jsonl")
    out = tmp_path / "regen"
    kwargs = {"enable_thinking": False}
    result = regenerate(
        served.url,
        [str(tmp_path / "chat.jsonl"), f"{tmp_path / 'sg.jsonl'}?name=sg"],
        out,
        "--concurrency",
        "4",
        "--chunk-rows",
        "4",
        "--chat-template-kwargs",
        json.dumps(kwargs),
    )
    with_tools = sum(any(m["role"] == "tool" for m in r["messages"]) for r in chat)
    assert with_tools and f"{with_tools} rows regenerated up to their first tool call" in result.stdout
    assert "1 text or token rows (no prompts)" in result.stdout
    rows = written(out)
    expected = {f"chat/{r['id']}" for r in chat} | {f"sg/{i}" for i in range(3)}
    assert sorted(r["id"] for r in rows) == sorted(expected)  # each once

    # Each turn is what the server answers to the prompts with the replies before it (an independent client).
    client = OpenAI(base_url=served.url, api_key="none")
    originals = {f"chat/{r['id']}": r for r in chat} | {f"sg/{i}": r for i, r in enumerate(sharegpt)}
    turns = 0
    for row in rows:
        messages = row["messages"]
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            sent = [
                {key: v for key, v in m.items() if key in ("role", "content") and v is not None}
                for m in messages[:k]
            ]
            extra = {"tools": row["tools"]} if row.get("tools") else {}
            again = client.chat.completions.create(
                model=MODEL,
                messages=sent,
                max_tokens=5,
                temperature=0,
                extra_body={"chat_template_kwargs": kwargs},
                **extra,
            )
            assert message["content"] == again.choices[0].message.content, (row["id"], k)
            assert message["finish_reason"] == again.choices[0].finish_reason
            turns += 1
        # The user turns are the dataset's, in order, up to its first tool result.
        original = originals[row["id"]]
        if "conversations" in original:
            users = [t["value"] for t in original["conversations"] if t["from"] == "human"]
        else:
            before_tool = []
            for m in original["messages"]:
                if m["role"] == "tool":
                    break
                before_tool.append(m)
            users = [m["content"] for m in before_tool if m["role"] == "user"]
        assert [m["content"] for m in messages if m["role"] == "user"] == users, row["id"]
        assert sum(m["role"] == "assistant" for m in messages) == len(users)
    assert f"over {turns} requests (0 retries)" in result.stdout
    # transformers serve refuses return_token_ids (HTTP 422): asked again without it, its replies carry no ids.
    assert "the servers gave no token ids" in result.stdout
    assert not any("token_ids" in m for row in rows for m in row["messages"])

    # run takes the directory as it is; its data report names the served model and the options.
    run = run_cli(
        "run",
        "--model",
        tiny_model,
        "--data",
        out,
        "--output",
        tmp_path / "out",
        "--run-dir",
        tmp_path / "run",
        "--staging",
        tmp_path / "staging",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-length",
        "1024",
        "--max-tokens-per-batch",
        "4096",
        "--no-progress",
        "--chat-template-kwargs",  # the regeneration's: run refuses other ones
        json.dumps(kwargs),
    )
    assert (
        f'replies of {MODEL} (max_tokens 5, temperature 0.0, chat_template_kwargs {{"enable_thinking": false}}, '
        "turns all); token ids: 0 rows the server's" in run.stdout
    )
    output = open_output(str(tmp_path / "out"))
    assert sorted(output.sample_ids()) == sorted(expected)
    for row in rows:
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        text = tiny_tokenizer.apply_chat_template(messages, tools=row.get("tools"), tokenize=False, **kwargs)
        # Cut at --max-tokens: the row ends where the model stopped, without the template's <|im_end|>.
        if messages[-1]["finish_reason"] == "length":
            text = text[: text.rfind("<|im_end|>")]
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert output[row["id"]]["input_ids"].tolist() == list(ids), row["id"]


def test_sigkill_then_the_same_command_gives_every_row_once_and_repeats_no_written_row(proxy, tmp_path):
    rows = prompt_rows(24)
    write_jsonl(rows, tmp_path / "prompts.jsonl")
    out = tmp_path / "regen"
    proxy.delay_s = 0.15
    args = [
        "regenerate",
        "--endpoint",
        proxy.url,
        "--served-model",
        MODEL,
        "--output",
        str(out),
        "--no-progress",
        "--data",
        str(tmp_path / "prompts.jsonl"),
        "--temperature",
        "0",
        "--max-tokens",
        "5",
        "--concurrency",
        "2",
        "--chunk-rows",
        "3",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsextract.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    deadline = time.monotonic() + 120
    while (
        len(list(out.glob("chunk-*.jsonl.zst"))) < 2 and time.monotonic() < deadline and proc.poll() is None
    ):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    from hsextract.regenerate.ledger import Ledger

    at_kill = Ledger(str(out)).done().written
    assert 6 <= len(at_kill) < 24, len(at_kill)
    proxy.clear()
    proxy.delay_s = 0.0
    again = run_cli(*args, timeout=240)
    assert f"{len(at_kill)} were there already" in again.stdout
    final = written(out)
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in rows)  # every row once, no chunk torn
    asked_again = {text.split(":")[0] for text in proxy.seen}
    assert not asked_again & {f"row-{r['id'][1:]}" for r in rows if r["id"] in at_kill}
    assert len(proxy.seen) == 24 - len(at_kill)


def test_5xx_stalls_and_dropped_connections_are_retried(proxy, tmp_path):
    write_jsonl(prompt_rows(8), tmp_path / "prompts.jsonl")
    proxy.plant("status", 3, status=500)
    proxy.plant("status", 1, status=429)
    proxy.plant("stall", 2)
    proxy.plant("drop", 2)
    out = tmp_path / "regen"
    started = time.monotonic()
    result = regenerate(
        proxy.url,
        str(tmp_path / "prompts.jsonl"),
        out,
        "--request-timeout",
        "2",
        "--max-retries",
        "8",
        "--concurrency",
        "4",
    )
    assert time.monotonic() - started < 60
    # The 8 planted failures are retried; a loaded machine may time out more requests.
    retries = re.search(r"\((\d+) retries\)", result.stdout)
    assert retries and int(retries.group(1)) >= 8 and "failed" not in result.stdout, result.stdout
    assert sorted(r["id"] for r in written(out)) == [f"p{i}" for i in range(8)]
    assert all(r["messages"][-1]["finish_reason"] in ("length", "stop") for r in written(out))


def test_a_row_that_keeps_failing_is_counted_then_requested_by_the_next_run(proxy, tmp_path):
    write_jsonl(prompt_rows(6), tmp_path / "prompts.jsonl")
    proxy.plant("status", None, match="row-4:", status=502)
    out = tmp_path / "regen"
    result = regenerate(proxy.url, str(tmp_path / "prompts.jsonl"), out, "--max-retries", "1", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "failed: 1 rows (1 HTTP 502 (2 tries)); not written: rerun the same command" in result.stdout
    assert sorted(r["id"] for r in written(out)) == ["p0", "p1", "p2", "p3", "p5"]
    proxy.clear()
    again = regenerate(proxy.url, str(tmp_path / "prompts.jsonl"), out, "--max-retries", "1")
    assert "5 were there already" in again.stdout
    assert [s.split(":")[0] for s in proxy.seen] == ["row-4"]
    assert sorted(r["id"] for r in written(out)) == [f"p{i}" for i in range(6)]


def test_an_endpoint_that_keeps_failing_is_taken_out_and_its_rows_go_to_the_other(served, proxy, tmp_path):
    write_jsonl(prompt_rows(16), tmp_path / "prompts.jsonl")
    proxy.plant("status", None, status=503)  # its /v1/models answers: it fails only once the run is on
    out = tmp_path / "regen"
    result = regenerate(
        [proxy.url, served.url],
        str(tmp_path / "prompts.jsonl"),
        out,
        "--endpoint-down-after",
        "0.3",
        "--max-tokens",
        "12",
        "--concurrency",
        "4",
    )
    assert f"endpoint {proxy.url} failed for --endpoint-down-after and was taken out" in result.stdout
    assert sorted(r["id"] for r in written(out)) == sorted(f"p{i}" for i in range(16))
    assert "failed:" not in result.stdout


def test_a_model_the_server_does_not_serve_is_refused_listing_what_it_serves(served, tmp_path):
    write_jsonl(prompt_rows(2), tmp_path / "prompts.jsonl")
    result = run_cli(
        "regenerate",
        "--endpoint",
        served.url,
        "--served-model",
        "Qwen/Qwen3.6-27B",
        "--data",
        tmp_path / "prompts.jsonl",
        "--output",
        tmp_path / "regen",
        check=False,
    )
    assert result.returncode == 2
    assert "does not serve --served-model Qwen/Qwen3.6-27B: its /v1/models lists" in result.stderr
    assert MODEL in result.stderr
