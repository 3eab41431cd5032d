"""Chat completions from one or more OpenAI-compatible servers, many requests in flight in one process.

Requests go to the healthy endpoint with the fewest in flight; what may succeed later (429, 5xx, timeouts, dropped
connections) is retried with backoff, then the row fails and is left for the next run. An endpoint failing for
``endpoint_down_s`` leaves the rotation; a refused key, no endpoint left, or a first run of refused requests stops
the run with its reason, instead of failing every row.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from hsextract.errors import HsextractError
from hsextract.regenerate import token_ids
from hsextract.regenerate.replies import Provenance, message_problem

CHECK_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
REFUSALS_BEFORE_STOP = 20

"""Requests refused (4xx) in a row, with none answered yet, after which the run stops: they all would be."""


class Stop(HsextractError):
    """The run cannot go on (the key refused, every endpoint down, every request refused): no row is requested
    any more; finished rows are still written."""


class RowFailed(Exception):
    """A request failed for good in this run; ``cause`` counts it in the report."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to wait before retrying a request that may succeed later."""

    max_retries: int = 5
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    @staticmethod
    def retried(status: int) -> bool:
        """429 (overloaded), 408 and every 5xx are worth another try; other statuses are answers."""
        return status in (408, 429) or 500 <= status < 600

    def delay(self, retry: int, retry_after: float | None = None, draw=random.random) -> float:
        """Seconds before retry number ``retry`` (0-based): doubling from ``first_backoff_s`` up to
        ``max_backoff_s``, times a draw in [0.5, 1) so that requests that failed together do not return
        together; at least the server's ``Retry-After`` (capped like the rest)."""
        base = min(self.max_backoff_s, self.first_backoff_s * 2**retry)
        wait = base * (0.5 + 0.5 * draw())
        if retry_after is not None and retry_after > 0:
            wait = max(wait, min(retry_after, self.max_backoff_s))
        return wait


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    failing_since: float | None = None
    """When its current run of failures began (None after a success)."""
    down: bool = False
    listed: list[str] | None = None
    """The model ids its ``/v1/models`` listed (None: none asked or none listed)."""
    answers_as: str | None = None
    """The ``model`` its first stored reply named: every later reply must name it too (replies.py)."""
    gives_ids: bool = True
    """Asked for token ids until it refuses the field (``token_ids.refuses_fields``)."""

    def succeeded(self) -> None:
        self.failing_since = None

    def failed(self, now: float, down_after_s: float) -> bool:
        """Count a failure; True when this one takes the endpoint out of the rotation."""
        if self.failing_since is None:
            self.failing_since = now
        if not self.down and now - self.failing_since >= down_after_s:
            self.down = True
            return True
        return False


@dataclass
class EndpointPool:
    endpoints: list[Endpoint]
    down_after_s: float
    went_down: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, urls, down_after_s: float, listed: dict | None = None) -> EndpointPool:
        """``listed``: the model ids each URL's ``/v1/models`` listed (``check_endpoints``)."""
        return cls([Endpoint(u, listed=(listed or {}).get(u)) for u in urls], down_after_s)

    def pick(self, avoid: Endpoint | None = None) -> Endpoint:
        """The healthy endpoint with the fewest requests in flight, other than ``avoid`` where possible."""
        healthy = [e for e in self.endpoints if not e.down]
        if not healthy:
            raise Stop(
                "every endpoint failed for "
                f"{self.down_after_s:g} s and was taken out ({', '.join(self.went_down)}): rows not written are "
                "requested again by the next run; check the servers, then rerun the same command"
            )
        others = [e for e in healthy if e is not avoid] or healthy
        return min(others, key=lambda e: e.in_flight)

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.endpoints)

    def failed(self, endpoint: Endpoint) -> None:
        if endpoint.failed(time.monotonic(), self.down_after_s):
            self.went_down.append(endpoint.url)


ASK_WITHOUT_IDS = object()

"""An endpoint refused the token-id fields: the request goes again without them (no retry counted)."""


@dataclass(frozen=True)
class Retry:
    """A try that may succeed later: why it failed, the server's ``Retry-After``, whether the endpoint is to blame."""

    cause: str
    retry_after: float | None = None
    endpoint_fault: bool = True


@dataclass
class Counters:
    """What a client did, as the closing report states it: requests sent (retries included), retries, and the
    completion tokens of the answers."""

    requests: int = 0
    retries: int = 0
    tokens: int = 0
    with_ids: int = 0
    """Replies that carry the server's token ids."""


class ChatClient:
    """``complete(messages, tools)`` -> the reply as stored (the server's message with its ``finish_reason``)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: EndpointPool,
        served_model: str,
        options: dict,
        *,
        headers: dict | None = None,
        policy: RetryPolicy | None = None,
        timeout_s: float = 600.0,
        key_env: str | None = None,
        counters: Counters | None = None,
    ):
        self.session, self.pool, self.policy = session, pool, policy or RetryPolicy()
        self.served_model, self.options = served_model, options
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        self.key_env = key_env
        self.counters = counters if counters is not None else Counters()
        # The refusal rule's state: refusals since the last answer, and whether any request was answered yet.
        self.refused_in_a_row = 0
        self.answered_any = False
        self.provenance = Provenance(served_model)

    async def complete(self, messages: list[dict], tools: list | None) -> dict:
        body = {"model": self.served_model, "messages": messages, **self.options}
        if tools:
            body["tools"] = tools
        data = {True: token_ids.body(body, True), False: token_ids.body(body, False)}
        retry, avoid = 0, None
        while True:
            endpoint = self.pool.pick(avoid)
            asked_ids = endpoint.gives_ids
            outcome = await self._attempt(endpoint, data[asked_ids], asked_ids)
            if outcome is ASK_WITHOUT_IDS:
                continue
            if not isinstance(outcome, Retry):
                return outcome
            if outcome.endpoint_fault:
                self.pool.failed(endpoint)
            if retry >= self.policy.max_retries:
                raise RowFailed(f"{outcome.cause} ({retry + 1} tries)")
            self.counters.retries += 1
            await asyncio.sleep(self.policy.delay(retry, outcome.retry_after))
            retry, avoid = retry + 1, endpoint

    def _reply(self, endpoint: Endpoint, payload: bytes) -> dict | Retry:
        """A 200's reply when it is one to store, else a ``Retry`` saying why not."""
        try:
            reply, tokens, response = parse_reply(payload)
        except ValueError as e:
            return Retry(f"bad reply ({e})")
        if (problem := self.provenance.problem(endpoint, response["model"], response["id"])) is not None:
            return Retry(problem)
        self.provenance.accept(endpoint, response["model"], response["id"])
        endpoint.succeeded()
        self.counters.tokens += tokens
        self.counters.with_ids += token_ids.COMPLETION_IDS in reply
        self.answered_any, self.refused_in_a_row = True, 0
        return reply

    async def _attempt(
        self, endpoint: Endpoint, data: bytes, asked_ids: bool = False
    ) -> dict | Retry | object:
        """The reply, a ``Retry`` or ``ASK_WITHOUT_IDS``; raises ``RowFailed`` for a refused request and ``Stop``
        for a refused key."""
        counters = self.counters
        counters.requests += 1
        endpoint.in_flight += 1
        try:
            async with self.session.post(
                endpoint.url + "/chat/completions", data=data, headers=self.headers, timeout=self.timeout
            ) as response:
                status = response.status
                if status != 200:  # before the first await: the connection is still this request's
                    _close_connection(response)
                payload = await response.read()
                retry_after = _retry_after(response.headers.get("Retry-After"))
                outcome = self._reply(endpoint, payload) if status == 200 else None
                if isinstance(outcome, Retry):
                    _close_connection(response)
        except asyncio.TimeoutError:
            return Retry("timeout")
        except aiohttp.ClientConnectorError:
            return Retry("connection refused")
        except (aiohttp.ClientError, OSError):  # dropped mid-reply, reset, closed without an answer
            return Retry("connection dropped")
        finally:
            endpoint.in_flight -= 1
        if outcome is not None:
            return outcome
        if status in (401, 403):
            raise Stop(auth_message(endpoint.url, status, self.key_env))
        if self.policy.retried(status):
            return Retry(f"HTTP {status}", retry_after, endpoint_fault=status != 429)  # 429: busy, not broken
        if asked_ids and token_ids.refuses_fields(status, payload):
            endpoint.gives_ids = False
            counters.requests -= 1  # asked again at once, as if never sent
            return ASK_WITHOUT_IDS
        self.refused_in_a_row += 1
        detail = _detail(payload)
        if not self.answered_any and self.refused_in_a_row >= REFUSALS_BEFORE_STOP:
            raise Stop(
                f"POST {endpoint.url}/chat/completions refused the first {self.refused_in_a_row} requests "
                f"(HTTP {status}: {detail}); check the sampling options and --served-model"
            )
        raise RowFailed(f"refused (HTTP {status}: {detail})")


def parse_reply(payload: bytes) -> tuple[dict, int, dict]:
    """The stored reply (the one choice's message as returned, plus its ``finish_reason`` and the server's token
    ids where it gave them), the completion tokens the server counted, and the response's ``model`` and ``id``;
    ``ValueError`` naming what makes the reply one not to store (replies.py)."""
    try:
        data = json.loads(payload)
        choices = data["choices"]
        choice = choices[0]
        message = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError) as e:
        raise ValueError(f"no choices[0].message in the response: {type(e).__name__}") from None
    if len(choices) != 1 or choice.get("index", 0) != 0:
        raise ValueError(f"{len(choices)} choices where one was asked")
    if not isinstance(message, dict):
        raise ValueError("choices[0].message is not an object")
    if (problem := message_problem(message)) is not None:
        raise ValueError(problem)
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens")
    reply = {**message, "finish_reason": choice.get("finish_reason"), **token_ids.reply_ids(data, choice)}
    return reply, tokens if isinstance(tokens, int) else 0, {"model": data.get("model"), "id": data.get("id")}


def _close_connection(response) -> None:
    """Close the connection ``response`` came on: what it carries next may be a copy of this answer, not the answer
    to the request sent next. Still held, it is closed when aiohttp releases it; released already (the answer came
    whole with its headers), it is idle in the pool, closed at once. Before the response's first ``await`` nothing
    else ran since the release, so no other request holds it; after one (a 200 found bad once read), another request
    may have taken it meanwhile, and fails with it (a retry)."""
    connection = response.connection
    if connection is not None and connection.protocol is not None:
        connection.protocol.force_close()
    elif (protocol := getattr(response, "_protocol", None)) is not None:
        protocol.close()


def auth_message(url: str, status: int, key_env: str | None) -> str:
    if key_env:
        return f"{url} refused the API key in ${key_env} (HTTP {status}): check the key that variable holds"
    return f"{url} wants an API key (HTTP {status}): put it in an environment variable and pass --api-key-env NAME"


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _detail(payload: bytes) -> str:
    """The server's own words about a refused request, short."""
    try:
        data = json.loads(payload)
        error = data.get("error", data.get("detail", data)) if isinstance(data, dict) else data
        text = error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        text = payload.decode(errors="replace")
    return " ".join(str(text).split())[:300]


async def check_endpoints(
    session: aiohttp.ClientSession, urls, served_model: str, headers: dict, key_env: str | None
) -> dict:
    """Every endpoint's ``/models``, at once: one that refuses connections, does not answer, refuses the key or
    does not list the model is an error naming it. Returns the model ids each listed."""
    results = await asyncio.gather(*(_check(session, url, served_model, headers, key_env) for url in urls))
    return dict(zip(urls, results, strict=True))


async def _check(
    session, url: str, served_model: str, headers: dict, key_env: str | None
) -> list[str] | None:
    timeout = aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S, sock_connect=CHECK_TIMEOUT_S)
    try:
        async with session.get(url + "/models", headers=headers, timeout=timeout) as response:
            status, payload = response.status, await response.read()
    except aiohttp.ClientConnectorError as e:
        raise HsextractError(
            f"endpoint {url} refuses connections ({e.os_error or e}): is its server up and listening there? "
            "(leave that --endpoint out to go on without it)"
        ) from None
    except asyncio.TimeoutError:
        raise HsextractError(
            f"endpoint {url} does not answer GET /models within {CHECK_TIMEOUT_S:g} s"
        ) from None
    except (aiohttp.ClientError, OSError) as e:
        raise HsextractError(f"endpoint {url} cannot be reached: {type(e).__name__} {e}") from None
    if status in (401, 403):
        raise HsextractError(auth_message(url, status, key_env))
    if status == 404:
        raise HsextractError(
            f"endpoint {url}: GET {url}/models answered 404 (not found): --endpoint is expected to be the base URL "
            "of an OpenAI-compatible server, the one /models and /chat/completions hang off "
            "(e.g. http://HOST:8000/v1); check the host, port and path"
        )
    if status != 200:
        return None  # some servers list no models (or not this one): the first request decides
    try:
        ids = [m["id"] for m in json.loads(payload)["data"]]
    except (ValueError, KeyError, TypeError):
        return None
    if ids and served_model not in ids:
        raise HsextractError(
            f"endpoint {url} does not serve --served-model {served_model}: its /v1/models lists "
            f"{', '.join(map(str, ids))}"
        )
    return ids
