"""Retries, backoff and endpoints going down (regenerate/client.py); requests go to a real HTTP server on
loopback (tests/support/chat_servers.py)."""

import asyncio
import json

import aiohttp
import pytest
from support.chat_servers import DELETE, REPLY, FaultProxy, InstantServer

from hsextract.regenerate.client import (
    REFUSALS_BEFORE_STOP,
    ChatClient,
    Endpoint,
    EndpointPool,
    RetryPolicy,
    RowFailed,
    Stop,
    parse_reply,
)

FAST = RetryPolicy(max_retries=2, first_backoff_s=0.001, max_backoff_s=0.004)


def test_backoff_doubles_with_jitter_up_to_its_cap_and_honours_retry_after():
    policy = RetryPolicy(max_retries=9, first_backoff_s=0.5, max_backoff_s=30.0)
    assert [policy.delay(r, draw=lambda: 1.0) for r in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert [policy.delay(r, draw=lambda: 0.0) for r in range(3)] == [0.25, 0.5, 1.0]
    assert policy.delay(0, retry_after=7, draw=lambda: 0.0) == 7
    assert policy.delay(0, retry_after=600, draw=lambda: 0.0) == 30  # capped like the rest
    assert [s for s in (400, 401, 404, 408, 422, 429, 500, 502, 503, 599) if policy.retried(s)] == [
        408,
        429,
        500,
        502,
        503,
        599,
    ]


def test_the_pool_picks_the_least_busy_endpoint_and_takes_out_one_that_keeps_failing():
    pool = EndpointPool.of(["http://a/v1", "http://b/v1"], down_after_s=10.0)
    a, b = pool.endpoints
    a.in_flight = 3
    assert pool.pick() is b
    assert pool.pick(avoid=b) is a  # a retry goes elsewhere while there is elsewhere
    assert not a.failed(now=100.0, down_after_s=10.0) and not a.failed(now=109.0, down_after_s=10.0)
    a.succeeded()  # a success in between: the failures start counting again
    assert not a.failed(now=115.0, down_after_s=10.0)
    assert a.failed(now=125.0, down_after_s=10.0) and a.down
    assert pool.pick() is b and pool.pick(avoid=b) is b
    b.down = True
    pool.went_down = ["http://a/v1", "http://b/v1"]
    with pytest.raises(Stop, match="every endpoint failed"):
        pool.pick()


def test_a_reply_is_kept_as_the_server_returned_it():
    payload = json.dumps(
        {
            "choices": [
                {
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": "r",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"completion_tokens": 7},
        }
    ).encode()
    reply, tokens, _ = parse_reply(payload)
    assert tokens == 7 and reply["finish_reason"] == "tool_calls" and reply["content"] is None
    assert reply["tool_calls"][0]["function"]["arguments"] == "{}"
    for bad in (b"not json", b"{}", b'{"choices": []}', b'{"choices": [{"message": "text"}]}'):
        with pytest.raises(ValueError):
            parse_reply(bad)


async def _complete(server, policy=FAST, key_env=None, n=1):
    async with aiohttp.ClientSession() as session:
        pool = EndpointPool.of([server.url], down_after_s=60.0)
        client = ChatClient(session, pool, "instant", {"max_tokens": 4}, policy=policy, key_env=key_env)
        results = await asyncio.gather(
            *(client.complete([{"role": "user", "content": "q"}], None) for _ in range(n)),
            return_exceptions=True,
        )
        return client, results


@pytest.fixture
def server():
    s = InstantServer()
    yield s
    s.stop()


def test_answers_come_back_with_their_tokens_counted(server):
    client, results = asyncio.run(_complete(server, n=5))
    assert results == [{**REPLY, "finish_reason": "stop"}] * 5
    assert client.counters.tokens == 20 and client.counters.requests == 5 and client.pool.in_flight == 0


def test_a_server_error_is_retried_a_bounded_number_of_times_then_fails_the_row(server):
    server.status = 503
    client, results = asyncio.run(_complete(server))
    assert isinstance(results[0], RowFailed) and results[0].cause == "HTTP 503 (3 tries)"
    assert server.requests == 3 and client.counters.retries == 2


def test_a_refused_request_fails_its_row_at_once_and_a_run_of_them_stops(server):
    server.status = 400
    client, results = asyncio.run(_complete(server))
    assert isinstance(results[0], RowFailed) and results[0].cause == "refused (HTTP 400: refused)"
    assert server.requests == 1
    server.requests = 0
    client, results = asyncio.run(_complete(server, n=REFUSALS_BEFORE_STOP))
    assert any(isinstance(r, Stop) for r in results)


def test_a_refused_key_stops_naming_its_variable(server):
    server.status = 401
    client, results = asyncio.run(_complete(server, key_env="MY_KEY"))
    assert isinstance(results[0], Stop) and "$MY_KEY" in str(results[0])
    assert server.requests == 1


def test_an_endpoint_that_refuses_connections_is_retried_then_fails_the_row():
    async def run():
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool([Endpoint("http://127.0.0.1:9/v1")], down_after_s=60.0)
            client = ChatClient(session, pool, "m", {}, policy=FAST)
            with pytest.raises(RowFailed, match="connection refused"):
                await client.complete([{"role": "user", "content": "q"}], None)

    asyncio.run(run())


@pytest.fixture
def proxied():
    upstream = InstantServer(echo=True)
    proxy = FaultProxy(upstream.url)
    yield upstream, proxy
    proxy.stop()
    upstream.stop()


async def _in_turn(url, prompts, policy=FAST, served_model="instant", listed=None):
    """Each prompt's reply or failure, one request after the other (so that they share a keep-alive connection)."""
    async with aiohttp.ClientSession() as session:
        pool = EndpointPool.of([url], down_after_s=60.0, listed={url: listed} if listed else None)
        client = ChatClient(session, pool, served_model, {}, policy=policy)
        results = []
        for prompt in prompts:
            try:
                results.append(await client.complete([{"role": "user", "content": prompt}], None))
            except RowFailed as e:
                results.append(e)
        return client, results


@pytest.mark.parametrize(
    "message, cause",
    [
        ({"role": DELETE}, "reply with no role"),
        ({"role": "user"}, "reply of role 'user', not assistant"),
        ({"content": None}, "reply with null content and no tool call or reasoning"),
        ({"content": "half a pair \ud83d"}, "reply holding half a surrogate pair"),
        ({"content": ["parts"]}, "reply whose content is not a string"),
    ],
)
def test_a_reply_that_is_no_assistant_message_is_retried_then_fails_with_its_reason(proxied, message, cause):
    upstream, proxy = proxied
    proxy.plant("reply", None, match="q1", message=message)
    client, results = asyncio.run(_in_turn(proxy.url, ["q0", "q1", "q2"]))
    assert results[0]["content"] == "re: q0" and results[2]["content"] == "re: q2"
    assert (
        isinstance(results[1], RowFailed)
        and results[1].cause == f"bad reply ({cause}) (3 tries)"
        or cause in results[1].cause
    )
    assert upstream.requests == 5  # the bad one asked 3 times


def test_a_reply_of_another_model_is_not_stored_even_when_the_server_switches_mid_run(proxied):
    upstream, proxy = proxied
    proxy.plant("model", None, match="late", model="other/model")
    client, results = asyncio.run(_in_turn(proxy.url, ["q0", "late q1", "q2"]))
    assert results[0]["content"] == "re: q0" and results[2]["content"] == "re: q2"
    assert results[1].cause == "reply of model other/model (its first replies were instant) (3 tries)"
    proxy.clear()
    proxy.plant("model", None, model="other/model")
    _, results = asyncio.run(_in_turn(proxy.url, ["q0"]))
    assert results[0].cause == "reply of model other/model, not instant (3 tries)"
    # Names that are the model asked: a revision (transformers serve answers hsextract/m@main), an alias the
    # server lists (vLLM answers with its first --served-model-name).
    for named, listed in (("instant@main", None), ("first-alias", ["first-alias", "instant"])):
        proxy.clear()
        proxy.plant("model", None, model=named)
        _, results = asyncio.run(_in_turn(proxy.url, ["q0", "q1"], listed=listed))
        assert [r["content"] for r in results] == ["re: q0", "re: q1"], results


def test_an_answer_written_twice_on_a_connection_never_answers_another_request(proxied):
    upstream, proxy = proxied
    proxy.plant("twice", None)
    prompts = [f"q{i}" for i in range(40)]

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=3)) as session:
            pool = EndpointPool.of([proxy.url], down_after_s=60.0)
            client = ChatClient(session, pool, "instant", {}, policy=RetryPolicy(8, 0.001, 0.004))
            queue = list(prompts)

            async def worker():  # four requests in turn over three connections: each goes where one is free
                replies = []
                while queue:
                    prompt = queue.pop(0)
                    reply = await client.complete([{"role": "user", "content": prompt}], None)
                    replies.append((prompt, reply["content"]))
                return replies

            done = await asyncio.gather(*(worker() for _ in range(4)))
            return client, [pair for replies in done for pair in replies]

    client, pairs = asyncio.run(run())
    assert len(pairs) == 40 and all(content == f"re: {prompt}" for prompt, content in pairs), pairs
    # Each stale copy is either refused (its request asked again) or dropped with its connection by aiohttp,
    # which of the two depends on when it arrives (a loaded machine saw no retry): never another request's reply.
