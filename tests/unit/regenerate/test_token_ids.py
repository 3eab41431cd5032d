"""The server's token ids, from request to row: ``regenerate`` asks for them, stores them on each reply as vLLM or
SGLang spells them, and ``run``'s rows are exactly the ids the loopback server sent (its record of each answer),
the completion in the loss; a deliberately wrong template is reported; a cut reply keeps no end-of-turn token; a
server that refuses the field (as ``transformers serve`` does) is asked again without it, and its rows are rendered
from text and counted so."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from click.testing import CliRunner
from support.chat_servers import InstantServer
from support.served_rows import CHAT_TEMPLATES
from support.tiktoken_tok import build_tiktoken_style_tokenizer

from hsextract.cli import main
from hsextract.prepare.chat import ChatOptions
from hsextract.prepare.tokenize import load_samples
from hsextract.regenerate.client import ChatClient, EndpointPool, RetryPolicy, parse_reply

# Real templates rendered turn by turn (and a loopback server): the slow tier, to keep the fast one in its budget.
pytestmark = pytest.mark.slow

COMPLETION = (101, 102, 103)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    template = (CHAT_TEMPLATES / "qwen3_6.jinja").read_text()
    return build_tiktoken_style_tokenizer(
        tmp_path_factory.mktemp("tok"), ranks=4000, specials=33, chat_template=template
    )


ANSWER = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(
    "response",
    [
        {"prompt_token_ids": [1, 2], "choices": [{"message": ANSWER, "token_ids": [3, 4]}]},
        {"choices": [{"message": ANSWER, "prompt_token_ids": [1, 2], "response_token_ids": [3, 4]}]},
    ],
    ids=["vllm", "sglang"],
)
def test_both_servers_spellings_are_stored_the_same_way(response):
    reply, _, _ = parse_reply(json.dumps(response).encode())
    assert (reply["prompt_token_ids"], reply["token_ids"]) == ([1, 2], [3, 4])


def test_a_reply_without_ids_or_with_half_of_them_stores_none():
    for response in (
        {"choices": [{"message": ANSWER}]},
        {"prompt_token_ids": [1, 2], "choices": [{"message": ANSWER}]},
        {"prompt_token_ids": [1, "x"], "choices": [{"message": ANSWER, "token_ids": [3]}]},
    ):
        reply, _, _ = parse_reply(json.dumps(response).encode())
        assert "prompt_token_ids" not in reply and "token_ids" not in reply


def test_a_server_that_refuses_the_field_is_asked_again_without_it_from_then_on():
    server = InstantServer(strict=True)
    try:

        async def two_requests():
            async with aiohttp.ClientSession() as session:
                pool = EndpointPool.of([server.url], down_after_s=60.0)
                client = ChatClient(session, pool, "instant", {}, policy=RetryPolicy(max_retries=0))
                replies = [await client.complete([{"role": "user", "content": "q"}], None) for _ in range(2)]
                return client, replies

        client, replies = asyncio.run(two_requests())
    finally:
        server.stop()
    assert [r["content"] for r in replies] == ["an instant reply"] * 2
    assert server.refused_fields == 1 and server.requests == 3  # one refusal, then two plain requests
    assert client.counters.retries == 0 and client.counters.with_ids == 0 and client.counters.requests == 2


def test_refusals_of_the_field_on_requests_in_flight_cost_no_retry():
    """Requests sent with the field before the first refusal came back are each asked again without it: every one
    answered, counted once, no retry."""
    server = InstantServer(strict=True)
    try:

        async def at_once(n: int):
            async with aiohttp.ClientSession() as session:
                pool = EndpointPool.of([server.url], down_after_s=60.0)
                client = ChatClient(session, pool, "instant", {}, policy=RetryPolicy(max_retries=0))
                asked = [client.complete([{"role": "user", "content": f"q{i}"}], None) for i in range(n)]
                return client, await asyncio.gather(*asked)

        client, replies = asyncio.run(at_once(32))
    finally:
        server.stop()
    assert [r["content"] for r in replies] == ["an instant reply"] * 32
    assert server.refused_fields == 32 and client.counters.retries == 0 and client.counters.requests == 32


def test_a_request_asked_again_never_takes_a_connection_a_refusal_is_closing():
    """Refusals whose bodies come together (uvicorn writes the head, then the body; the client's loop was busy):
    aiohttp puts each connection back in the pool as its body completes, and the first request asked again takes
    the other's. Each refused connection is closed before then (as it is released), never under that request."""
    n = 4
    server = InstantServer(strict=True, delay_s=0.1)  # each refusal's body 0.1 s after its head
    try:

        async def refused_together():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as session:
                pool = EndpointPool.of([server.url], down_after_s=60.0)
                client = ChatClient(session, pool, "instant", {}, policy=RetryPolicy(max_retries=0))

                async def busy_while_the_bodies_come():
                    while server.refused_fields < n:
                        await asyncio.sleep(0.001)
                    await asyncio.sleep(0.03)  # the heads are read
                    time.sleep(0.3)  # blocks the loop: every body arrives meanwhile

                asked = [client.complete([{"role": "user", "content": f"q{i}"}], None) for i in range(n)]
                got = await asyncio.gather(busy_while_the_bodies_come(), *asked, return_exceptions=True)
                return client, got[1:]

        client, replies = asyncio.run(refused_together())
    finally:
        server.stop()
    failed = [r for r in replies if isinstance(r, Exception)]
    assert not failed  # a connection closed under its request: RowFailed('connection dropped (1 tries)')
    assert [r["content"] for r in replies] == ["an instant reply"] * n
    assert server.refused_fields == n and client.counters.retries == 0 and client.counters.requests == n


def conversations(n: int) -> list[dict]:
    return [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": "the dataset's answer"},
                {"role": "user", "content": f"and then {i}?"},
            ],
        }
        for i in range(n)
    ]


def regenerate(server, tmp_path, rows) -> str:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["regenerate", "--no-progress", "--endpoint", server.url, "--served-model", server.model]
    args += [
        "--data",
        str(data),
        "--output",
        str(out),
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return str(out), result.output


KWARGS = {"enable_thinking": False}


@pytest.mark.parametrize("ids_like", ["vllm", "sglang"])
def test_each_turns_row_is_exactly_the_ids_the_server_sent(tok, tmp_path, ids_like):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    server = InstantServer(tokenizer=tok, ids_like=ids_like, completion_ids=COMPLETION, end_id=end)
    try:
        out, output = regenerate(server, tmp_path, conversations(3))
    finally:
        server.stop()
    assert "6 replies carry the server's token ids" in output

    samples, report = load_samples(out, tok, max_length=4096, chat=ChatOptions.of(None, KWARGS, "per-turn"))

    assert len(samples) == len(server.sent) == 6
    rows = {tuple(samples.sample(i)[0].tolist()): samples.sample(i)[1].tolist() for i in range(len(samples))}
    assert set(rows) == {tuple(p + c) for p, c in server.sent}
    for prompt, completion in server.sent:
        assert rows[tuple(prompt + completion)] == [0] * len(prompt) + [1] * len(completion)
    assert report.token_ids == {"server": 6}, report.examples
    assert any("6 rows the server's, 0 rendered from text" in line for line in report.regenerated_lines())


def test_a_wrong_template_is_reported_and_a_cut_reply_keeps_no_end_of_turn_token(tok, tmp_path):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    server = InstantServer(tokenizer=tok, completion_ids=COMPLETION, end_id=end, finish_reason="length")
    try:
        out, _ = regenerate(server, tmp_path, conversations(2))
    finally:
        server.stop()

    samples, report = load_samples(out, tok, max_length=4096, chat=ChatOptions.of(None, KWARGS))
    for i in range(len(samples)):
        ids, mask = samples.sample(i)
        assert ids[-len(COMPLETION) :].tolist() == list(COMPLETION) and mask[-len(COMPLETION) :].all()
        assert end not in ids[-len(COMPLETION) :].tolist()
    assert "prompt_differs" not in report.token_ids

    # The server rendered with thinking off; rendering with it on is the mistake a user must hear about.
    _, report = load_samples(out, tok, max_length=4096, chat=ChatOptions.of(None, {"enable_thinking": True}))
    assert report.token_ids == {"server": 2, "prompt_differs": 2}
    reason = next(e["reason"] for e in report.examples if e["kind"] == "prompt_differs")
    assert reason.startswith("turn 1: token ") and "the server has" in reason


def test_a_server_without_ids_is_rendered_from_text_and_counted(tok, tmp_path):
    server = InstantServer(strict=True)
    try:
        out, output = regenerate(server, tmp_path, conversations(2))
    finally:
        server.stop()
    assert "the servers gave no token ids" in output

    _, report = load_samples(out, tok, max_length=4096, chat=ChatOptions.of(None, KWARGS))

    assert report.token_ids == {"text": 2}
    assert any("0 rows the server's, 2 rendered from text" in line for line in report.regenerated_lines())
