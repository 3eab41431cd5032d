"""OpenAI-compatible servers on loopback for ``hsextract regenerate``: the real one and what stands in front of it.

- ``start_transformers_serve``: transformers' own ``transformers serve`` over a tiny model laid out as a Hub
  snapshot in a Hugging Face cache of its own (served offline, on the CPU, under the Hub id it is asked for).
- ``FaultProxy``: forwards to an upstream server and plants faults the tests choose (5xx answers, stalls,
  connections closed without an answer, a refused key, a reply edited, another model's name, an answer written
  twice on the connection), logging the first user message of every request it sees.
- ``InstantServer``: answers every chat request at once (or after ``delay_s``) with a fixed reply: the client's
  own cost is measured against it (scripts/bench_regenerate.py), in a thread or in a process of its own
  (``python tests/support/chat_servers.py PORT [DELAY_S]``). Given a tokenizer, it answers ``return_token_ids``
  as vLLM or SGLang does (the prompt ids rendered by the tokenizer's template, fixed completion ids); with
  ``strict`` it refuses fields it does not know, as ``transformers serve`` does (HTTP 422).
Each runs its asyncio loop in a thread of its own, so the test's thread stays free.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_cache_with(model_dir: Path, cache: Path, repo_id: str) -> Path:
    """``model_dir``'s files as the snapshot of Hub repo ``repo_id`` in a Hugging Face cache at ``cache``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return cache


class ServedModel:
    """A ``transformers serve`` process; ``url`` is its ``/v1`` base."""

    def __init__(self, proc: subprocess.Popen, port: int, model: str, log: Path):
        self.proc, self.port, self.model, self.log = proc, port, model, log
        self.url = f"http://127.0.0.1:{port}/v1"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def start_transformers_serve(
    model_dir: Path, root: Path, repo_id: str = "hsextract/tiny-qwen3_5", extra: list[str] | tuple = ()
) -> ServedModel:
    """``transformers serve`` pinned to ``repo_id`` (``model_dir`` in a cache of its own), offline, on the CPU,
    with ``extra`` options; returns once it listens."""
    cache = hub_cache_with(model_dir, root / "hf-cache", repo_id)
    port, log = free_port(), root / "serve.log"
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    serve = Path(sys.executable).with_name("transformers")
    command = [str(serve), "serve", repo_id, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--device", "cpu", "--dtype", "float32", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    served = ServedModel(proc, port, repo_id, log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return served
        except OSError:
            time.sleep(0.2)
    served.stop()
    raise RuntimeError(f"transformers serve did not listen within 180 s:\n{log.read_text()[-3000:]}")


class _LoopThread:
    """An aiohttp application served on 127.0.0.1 from a thread of its own."""

    def __init__(self, app: web.Application, port: int = 0):
        self.app, self._port = app, port
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self._ready.wait(30)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        # Handlers end with their connection (a planted stall, a client that timed out) and stop at once on stop().
        self.runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", self._port, backlog=4096)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _close(self) -> None:
        """What the application holds besides its server (a client session)."""

    def stop(self) -> None:
        async def close():
            await self.runner.cleanup()
            await self._close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def first_user_message(body: dict) -> str | None:
    return next((m.get("content") for m in body.get("messages") or [] if m.get("role") == "user"), None)


class FaultProxy(_LoopThread):
    """Forwards ``/v1/*`` to ``upstream``; each request is first offered to the faults planted (``plant``)."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.seen: list[str] = []
        """The first user message of every chat request that reached the proxy, in order; one the upstream refused
        for the token-id field is left out (regenerate asks it again at once and counts it once)."""
        self.refused_fields = 0
        """Chat requests the upstream refused for the token-id field (HTTP 422, as ``transformers serve``)."""
        self.faults: list[dict] = []
        self.delay_s = 0.0
        """Added before every chat request is forwarded (a slower server)."""
        self.lock = threading.Lock()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/v1/{tail:.*}", self._handle)
        self.session: ClientSession | None = None
        super().__init__(app)

    def plant(
        self,
        kind: str,
        times: int | None = None,
        *,
        match: str | None = None,
        status: int = 500,
        message: dict | None = None,
        model: str | None = None,
    ) -> None:
        """``kind``: ``status`` (answer ``status``), ``stall`` (never answer), ``drop`` (close the connection
        unanswered), ``reply`` (the upstream's reply with ``message``'s fields put in, ``DELETE`` removing one),
        ``model`` (the response names ``model``), ``twice`` (the response written twice on its keep-alive
        connection, as a broken proxy does); on the next ``times`` chat requests (None: all) whose body holds
        ``match`` (None: any)."""
        with self.lock:
            self.faults.append(
                {
                    "kind": kind,
                    "times": times,
                    "match": match,
                    "status": status,
                    "message": message,
                    "model": model,
                }
            )

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()
            self.seen.clear()

    async def _close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def _fault(self, text: str) -> dict | None:
        with self.lock:
            for fault in self.faults:
                if fault["times"] == 0 or (fault["match"] is not None and fault["match"] not in text):
                    continue
                if fault["times"] is not None:
                    fault["times"] -= 1
                return fault
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        fault = asked = None
        if request.path.endswith("/chat/completions"):
            text = data.decode(errors="replace")
            asked = first_user_message(json.loads(data))
            with self.lock:
                self.seen.append(asked)
            fault = self._fault(text)
            if fault is not None:
                if fault["kind"] == "status":
                    return web.json_response({"error": {"message": "planted fault"}}, status=fault["status"])
                if fault["kind"] == "stall":
                    await asyncio.sleep(3600)
                if fault["kind"] == "drop":
                    request.transport.close()
                    raise ConnectionResetError("planted: connection closed unanswered")
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        if self.session is None:
            self.session = ClientSession(timeout=ClientTimeout(total=600))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with self.session.request(
            request.method, self.upstream + request.path[len("/v1") :], data=data, headers=headers
        ) as upstream:
            body, status, content_type = await upstream.read(), upstream.status, upstream.content_type
        if status == 422 and b"return_token_ids" in body:
            with self.lock:
                self.refused_fields += 1
                if asked in self.seen:
                    self.seen.remove(asked)
        if fault is not None and fault["kind"] in ("reply", "model") and status == 200:
            answer = json.loads(body)
            if fault["kind"] == "model":
                answer["model"] = fault["model"]
            else:
                message = {**answer["choices"][0]["message"], **fault["message"]}
                answer["choices"][0]["message"] = {k: v for k, v in message.items() if v is not DELETE}
            body = json.dumps(answer).encode()  # ensure_ascii: half a surrogate pair travels as its escape
        if fault is not None and fault["kind"] == "twice":
            head = (
                f"HTTP/1.1 {status} OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            request.transport.write(head.encode() + body)  # then aiohttp writes the same answer once more
        return web.Response(body=body, status=status, content_type=content_type)


DELETE = object()

"""In a planted ``reply`` fault's ``message``: remove that field."""


REPLY = {"role": "assistant", "content": "an instant reply", "reasoning_content": None, "tool_calls": None}


KNOWN_FIELDS = {"model", "messages", "tools", "max_tokens", "temperature", "top_p", "top_k", "seed"}

"""What a ``strict`` server takes (``chat_template_kwargs`` too); anything else is refused as transformers serve does."""


class InstantServer(_LoopThread):
    """``/v1/models`` lists ``model``; every chat request is answered ``REPLY`` after ``delay_s``, or ``status``.

    With ``tokenizer``, a request asking ``return_token_ids`` gets ids as ``ids_like`` (``vllm`` or ``sglang``)
    spells them: the prompt rendered by the tokenizer's template (``chat_template_kwargs`` applied), the
    completion ``completion_ids`` followed by ``end_id`` unless ``finish_reason`` is ``length``; each answer's
    ids are kept in ``sent``; with ``echo``, the reply's content is ``re: `` and the request's first user message,
    so that a test can tell which request a stored reply answers."""

    def __init__(
        self,
        model: str = "instant",
        delay_s: float = 0.0,
        port: int = 0,
        status: int = 200,
        echo: bool = False,
        *,
        tokenizer=None,
        ids_like: str = "vllm",
        completion_ids: tuple = (),
        end_id: int | None = None,
        finish_reason: str = "stop",
        strict: bool = False,
    ):
        self.model, self.delay_s, self.status, self.echo = model, delay_s, status, echo
        self.tokenizer, self.ids_like, self.completion_ids = tokenizer, ids_like, list(completion_ids)
        self.end_id, self.finish_reason, self.strict = end_id, finish_reason, strict
        self.sent: list[tuple[list[int], list[int]]] = []
        self.refused_fields = 0
        self.chat_status: int | None = None
        """Chat requests' answer when not 200 (``status`` answers ``/v1/models`` too)."""
        self.requests = 0
        self.in_flight = 0
        self.most_in_flight = 0
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        super().__init__(app, port)

    async def _models(self, request: web.Request) -> web.Response:
        if self.status in (401, 403):
            return web.json_response({"error": {"message": "bad key"}}, status=self.status)
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        request_body = json.loads(await request.read())
        self.requests += 1
        unknown = set(request_body) - KNOWN_FIELDS - {"chat_template_kwargs"}
        if self.strict and unknown:  # transformers serve's words
            self.refused_fields += 1
            body = json.dumps({"detail": f"Unexpected fields in the request: {unknown}"}).encode()
            refusal = web.StreamResponse(status=422, headers={"Content-Type": "application/json"})
            refusal.content_length = len(body)
            # The head, then after ``delay_s`` the body, as uvicorn writes them.
            await refusal.prepare(request)
            await asyncio.sleep(self.delay_s)
            await refusal.write(body)
            await refusal.write_eof()
            return refusal
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        status = self.chat_status or self.status
        if status != 200:  # a refusal quoting the request's Authorization header, as some servers do
            auth = request.headers.get("Authorization")
            message = "refused" + (f" (Authorization: {auth})" if auth else "")
            return web.json_response({"error": {"message": message}}, status=status)
        reply = {**REPLY, "content": f"re: {first_user_message(request_body)}"} if self.echo else REPLY
        choice = {"index": 0, "message": reply, "finish_reason": self.finish_reason}
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",  # unique per answer: regenerate refuses an id seen before
            "object": "chat.completion",
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
        }
        if self.tokenizer is not None and request_body.get("return_token_ids"):
            prompt, completion = self._ids(request_body)
            self.sent.append((prompt, completion))
            if self.ids_like == "vllm":
                body["prompt_token_ids"], choice["token_ids"] = prompt, completion
            else:
                choice["prompt_token_ids"], choice["response_token_ids"] = prompt, completion
        return web.json_response(body)

    def _ids(self, request_body: dict) -> tuple[list[int], list[int]]:
        prompt = self.tokenizer.apply_chat_template(
            request_body["messages"],
            tools=request_body.get("tools"),
            add_generation_prompt=True,
            tokenize=True,
            **(request_body.get("chat_template_kwargs") or {}),
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        end = [] if self.finish_reason == "length" or self.end_id is None else [self.end_id]
        return prompt, [*self.completion_ids, *end]


if __name__ == "__main__":  # the benchmark's endpoint, in a process of its own; its counts when terminated
    import signal

    server = InstantServer(port=int(sys.argv[1]), delay_s=float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
    print(f"listening on {server.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    print(f"requests {server.requests} most_in_flight {server.most_in_flight}", flush=True)
    server.stop()
