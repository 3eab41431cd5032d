"""``hsextract regenerate`` from options to report: check the output and the servers, then answer every row.

Everything cheap (options, key, data, the output's settings, each server's ``/models``) is checked before the
first request. ``concurrency`` workers in one asyncio loop request each conversation's turns in order; full chunks
are written whole in a thread, one at a time. SIGINT and SIGTERM write the finished rows and say how to resume.
"""

from __future__ import annotations

import asyncio
import resource
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from hsextract.errors import HsextractError, redact
from hsextract.prepare.sources import Mix, resolve_sources
from hsextract.regenerate.client import (
    ChatClient,
    Counters,
    EndpointPool,
    RetryPolicy,
    RowFailed,
    Stop,
    check_endpoints,
)
from hsextract.regenerate.config import RegenerateConfig
from hsextract.regenerate.ledger import Ledger
from hsextract.regenerate.owner import own_output
from hsextract.regenerate.rows import Selection, select, to_request
from hsextract.regenerate.turns import Conversation
from hsextract.storage.fileio import user_cache_dir

PROGRESS_EVERY_S = 0.5
NOTES_SHOWN = 5


@dataclass
class Totals:
    """What this run did; ``lines()`` is the closing report."""

    written: int = 0
    dropped: int = 0
    chunks: int = 0
    truncated: int = 0
    cut_at_tool: int = 0
    failed: Counter = field(default_factory=Counter)
    client: Counters = field(default_factory=Counters)
    """The chat client's own counters (it counts into them)."""
    seconds: float = 0.0
    went_down: list[str] = field(default_factory=list)
    stopped: str = ""
    """Why the run stopped before its last row (a ``Stop``, or a signal)."""
    signal: int = 0

    def lines(self, selection: Selection, cfg: RegenerateConfig) -> list[str]:
        client = self.client
        rate = client.tokens / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"wrote {self.written} rows in {self.chunks} chunk(s) to {cfg.output}"
            + (f", dropped {self.dropped} truncated rows (--drop-truncated)" if self.dropped else "")
            + (f"; {selection.done} were there already" if selection.done else ""),
        ]
        if client.requests:
            lines.append(
                f"generated {client.tokens} tokens in {self.seconds:.1f} s: {rate:.1f} tok/s over "
                f"{client.requests} requests ({client.retries} retries)"
            )
        if client.requests and not client.with_ids:
            lines.append(
                "the servers gave no token ids: hsextract run renders these replies from their text (vLLM and SGLang "
                "give ids: docs/DATA.md)"
            )
        elif client.requests:
            lines.append(f"{client.with_ids} replies carry the server's token ids")
        for url in self.went_down:
            lines.append(f"endpoint {url} failed for --endpoint-down-after and was taken out of the rotation")
        if self.truncated:
            verb = "dropped" if cfg.drop_truncated else "kept"
            lines.append(
                f"{self.truncated} rows have a reply cut at --max-tokens (finish_reason length), {verb}"
            )
        if self.cut_at_tool:
            lines.append(
                f"{self.cut_at_tool} rows regenerated up to their first tool call (tool results answer "
                "the dataset's calls, not new ones)"
            )
        if self.failed:
            causes = ", ".join(f"{n} {cause}" for cause, n in self.failed.most_common())
            lines.append(
                f"failed: {sum(self.failed.values())} rows ({causes}); not written: rerun the same command to "
                "request them again"
            )
        return lines


class Chunks:
    """Finished rows gathered into chunks, each written whole (``Ledger.write_chunk``), one write at a time."""

    def __init__(self, ledger: Ledger, next_index: int, cfg: RegenerateConfig, totals: Totals):
        self.ledger, self.index, self.cfg, self.totals = ledger, next_index, cfg, totals
        self.rows: list[dict] = []
        self.dropped: list[str] = []
        self.since = time.monotonic()
        self.lock = asyncio.Lock()

    async def add(self, row: dict | None = None, dropped: str | None = None) -> None:
        if not self.rows and not self.dropped:
            self.since = time.monotonic()
        if row is not None:
            self.rows.append(row)
        if dropped is not None:
            self.dropped.append(dropped)
        if len(self.rows) + len(self.dropped) >= self.cfg.chunk_rows:
            await self.flush(partial=False)

    def stale(self) -> bool:
        return bool(self.rows or self.dropped) and time.monotonic() - self.since >= self.cfg.chunk_interval_s

    async def flush(self, partial: bool = True) -> None:
        """Write the full chunks gathered, and with ``partial`` what is left of one too."""
        n = self.cfg.chunk_rows
        async with self.lock:
            while len(self.rows) + len(self.dropped) >= (1 if partial else n):
                rows, self.rows = self.rows[:n], self.rows[n:]
                room = n - len(rows)
                dropped, self.dropped = self.dropped[:room], self.dropped[room:]
                index, self.index = self.index, self.index + 1
                await asyncio.to_thread(self.ledger.write_chunk, index, rows, dropped, self.cfg.compression)
                self.totals.written += len(rows)
                self.totals.dropped += len(dropped)
                self.totals.chunks += 1
                self.since = time.monotonic()


def regenerate(
    cfg: RegenerateConfig,
    *,
    restart: bool = False,
    show_progress: bool = True,
    echo: Callable = print,
    totals: Totals | None = None,
) -> int:
    """Run the job; 0 when every row is in the output, 1 when some failed. ``totals`` (given) is filled."""
    key = cfg.api_key()
    echo = _redacting(echo)
    with own_output(cfg.output):  # before the output is read: a second process touches nothing of the first's
        return _regenerate(cfg, key, restart=restart, show_progress=show_progress, echo=echo, totals=totals)


def _regenerate(cfg: RegenerateConfig, key, *, restart: bool, show_progress: bool, echo, totals) -> int:
    mix = resolve_sources(
        cfg.data, seed=cfg.data_seed, cache_dir=_cache_dir(), s3_endpoint_url=cfg.s3_endpoint_url
    )
    ledger = Ledger(cfg.output, cfg.s3_endpoint_url)
    settings = {**cfg.settings(), "data": mix.fingerprint()}
    sources = mix.describe()
    record = ledger.check_settings(settings, sources, restart=restart)
    mix = replace(mix, limit=cfg.max_samples)  # not a setting: a later run with more requests the rest
    done = ledger.done()
    for note in done.notes[:NOTES_SHOWN]:
        echo(f"output: {note}")
    if len(done.notes) > NOTES_SHOWN:
        echo(f"output: ... and {len(done.notes) - NOTES_SHOWN} more chunks like these")
    selection = select(mix, cfg.turns, cfg.dedupe, done)
    first = f" (the first of the mix, --max-samples {cfg.max_samples})" if cfg.max_samples else ""
    echo(f"data: {selection.summary()}{first}")
    for example in selection.examples:
        echo(f"  skipped {example}")
    if not selection.todo and not selection.done:
        raise HsextractError(f"no row of the data has prompts to answer: {selection.summary()}")
    _allow_sockets(cfg.concurrency)
    totals = totals if totals is not None else Totals()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    job = _Job(cfg, mix, ledger, selection, totals, headers, done.next_index, show_progress, echo)
    asyncio.run(job.run(write_record=None if record is not None else (settings, sources)))
    for line in totals.lines(selection, cfg):
        echo(line)
    if totals.signal:
        echo(totals.stopped)
        return 128 + totals.signal  # as a shell reports a process the signal ended
    if totals.stopped:
        raise Stop(totals.stopped)
    return 1 if totals.failed else 0


class _Job:
    def __init__(self, cfg, mix: Mix, ledger, selection, totals, headers, next_index, show_progress, echo):
        self.cfg, self.mix, self.ledger, self.selection, self.totals = cfg, mix, ledger, selection, totals
        self.headers, self.next_index, self.show_progress, self.echo = (
            headers,
            next_index,
            show_progress,
            echo,
        )
        self.stop_reason = ""
        self.writes: set[asyncio.Task] = set()

    async def run(self, write_record) -> None:
        import aiohttp

        cfg = self.cfg
        connector = aiohttp.TCPConnector(limit=cfg.concurrency, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            listed = await check_endpoints(
                session, cfg.endpoint, cfg.served_model, self.headers, cfg.api_key_env
            )
            if write_record is not None:
                served = {"model": cfg.served_model, "listed": listed}
                await asyncio.to_thread(self.ledger.write_settings, *write_record, served)
            if not self.selection.todo:
                return
            pool = EndpointPool.of(cfg.endpoint, cfg.endpoint_down_s, listed)
            client = ChatClient(
                session,
                pool,
                cfg.served_model,
                cfg.request_options(),
                headers=self.headers,
                policy=RetryPolicy(max_retries=cfg.max_retries),
                timeout_s=cfg.request_timeout_s,
                key_env=cfg.api_key_env,
                counters=self.totals.client,
            )
            await self._answer(client)

    async def _answer(self, client: ChatClient) -> None:
        from tqdm import tqdm

        cfg, totals = self.cfg, self.totals
        chunks = Chunks(self.ledger, self.next_index, cfg, totals)
        todo = to_request(self.mix, cfg.turns, cfg.dedupe, self.selection.todo)
        stop = asyncio.Event()
        self._on_signals(stop)
        bar = tqdm(
            total=len(self.selection.todo),
            desc="regenerate",
            unit="row",
            disable=not self.show_progress,
            dynamic_ncols=True,
        )
        started = time.monotonic()
        workers = [
            asyncio.create_task(self._worker(client, todo, chunks, bar))
            for _ in range(min(cfg.concurrency, len(self.selection.todo)))
        ]
        finished = asyncio.gather(*workers)
        finished.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here, or asyncio warns
        stopped = asyncio.create_task(stop.wait())
        try:
            while not finished.done():
                await asyncio.wait(
                    {finished, stopped}, timeout=PROGRESS_EVERY_S, return_when="FIRST_COMPLETED"
                )
                elapsed = time.monotonic() - started
                bar.set_postfix(
                    in_flight=client.pool.in_flight,
                    tok_s=f"{totals.client.tokens / max(elapsed, 1e-9):.0f}",
                    written=totals.written,
                    refresh=False,
                )
                if chunks.stale() and not self.writes:
                    write = asyncio.create_task(chunks.flush())
                    self.writes.add(write)
                    write.add_done_callback(self.writes.discard)
                if stop.is_set():
                    totals.stopped = self.stop_reason
                    break
            if not totals.stopped:
                await finished  # a worker's error surfaces here (Stop included)
        except Stop as e:
            totals.stopped = str(e)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            stopped.cancel()
            await chunks.flush()  # every finished row, whatever stopped the run
            bar.close()
            totals.seconds = time.monotonic() - started
            totals.went_down = list(client.pool.went_down)

    def _on_signals(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()

        def handle(sig: signal.Signals) -> None:
            self.stop_reason = (
                f"stopped by {sig.name}: the finished rows are written; rerun the same command to resume"
            )
            self.totals.signal = int(sig)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, handle, sig)
            except (
                NotImplementedError,
                RuntimeError,
                ValueError,
            ):  # not the main thread (tests call in-process)
                pass

    async def _worker(self, client: ChatClient, todo: Iterator[Conversation], chunks: Chunks, bar) -> None:
        totals = self.totals
        for conv in todo:
            replies: list[dict] = []
            cut = conv.cut_at_tool
            try:
                for turn in range(len(conv.prompts)):
                    reply = await client.complete(conv.request_messages(replies), conv.tools)
                    replies.append(reply)
                    if reply.get("tool_calls") and turn + 1 < len(conv.prompts):
                        cut = True  # no tool result answers this call: the conversation ends here
                        break
            except RowFailed as e:
                totals.failed[e.cause] += 1
                bar.update(1)
                continue
            totals.cut_at_tool += cut
            truncated = any(r.get("finish_reason") == "length" for r in replies)
            totals.truncated += truncated
            if truncated and self.cfg.drop_truncated:
                await chunks.add(dropped=conv.sample_id)
            else:
                await chunks.add(row=conv.output_row(replies))
            bar.update(1)


def _redacting(echo: Callable) -> Callable:
    """``echo`` of each line redacted: a server's words (a refusal, say) may hold the key (errors.hide)."""

    def say(line) -> None:
        echo(redact(str(line)))

    return say


def _cache_dir() -> Path:
    """Where S3 sources are fetched and file hashes kept, shared by every job of this user."""
    return user_cache_dir("regenerate", Path(tempfile.mkdtemp(prefix="hsextract-regenerate-")))


def _allow_sockets(concurrency: int) -> None:
    """One socket per request in flight: raise the open-files limit as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = concurrency + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
