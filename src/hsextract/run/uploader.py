"""The uploader: a separate process (no torch) that moves staged batch files into the output and records each.

A process, not a thread, so that checksums, TLS and boto3 never hold the worker's GIL. Per file: check the claim,
upload (verified against the writer's CRC32), write the completion record (the only record that a batch is done),
delete the staged file, tell the worker; a crash at any point is safe to rerun. It dies with its worker.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from hsextract.container import read_file_head
from hsextract.errors import HsextractError, StagedFileChanged, UploaderDied, disk_full, redact
from hsextract.output.ledger import check_claim, stored_record, write_done
from hsextract.run.procs import die_with_parent, log_to_file
from hsextract.storage import open_sink
from hsextract.storage.base import DEFAULT_RETRY_DEADLINE_S, Sink

log = logging.getLogger(__name__)


_POLL_S = 0.5


HEARTBEAT_S = 1.0

"""How often the child tells the worker that it is alive."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UploaderConfig:
    """What the child process needs; pickled to it at start."""

    output: str
    """``s3://bucket/prefix`` or a local directory."""
    endpoint_url: str | None
    """S3 endpoint; None falls back to ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` / AWS."""
    plan_hash: str = ""
    """The job this run writes: each upload first checks that the output's claim still names it, and each
    verified upload leaves a completion record for it in the output. Empty: neither (tests of the transfer alone)."""
    log_file: Path
    """The child logs here (appending): one line per upload, one per retry, and the error that stopped it."""
    concurrency: int = 4
    """Files uploaded at once."""
    retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S
    """How long one file's transient failures are retried before the uploader gives up."""
    parent_pid: int = 0
    """The worker's pid; the child exits when its parent changes."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.retry_deadline_s < 0:
            raise ValueError(f"retry_deadline_s must not be negative, got {self.retry_deadline_s}")


class Uploader:
    """Parent-side handle of the uploader process of one worker (shard)."""

    def __init__(
        self,
        *,
        output: str,
        endpoint_url: str | None,
        log_file: Path,
        plan_hash: str = "",
        concurrency: int = 4,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
    ) -> None:
        self.config = UploaderConfig(
            output=output,
            endpoint_url=endpoint_url,
            plan_hash=plan_hash,
            log_file=Path(log_file),
            concurrency=concurrency,
            retry_deadline_s=retry_deadline_s,
            parent_pid=os.getpid(),
        )
        self._process: multiprocessing.process.BaseProcess | None = None
        self._jobs: multiprocessing.Queue | None = None
        self._results: multiprocessing.Queue | None = None
        self._error: str | None = None
        self._unreported: list[str] = []
        self._closed = False
        self._heartbeat_at: float | None = None
        self._started_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def heartbeat_at(self) -> float | None:
        """When the child's last heartbeat was sent (read by ``poll_done``), or when it was started if none has
        arrived yet; None before ``start``."""
        return self._heartbeat_at if self._heartbeat_at is not None else self._started_at

    def start(self) -> None:
        """Start the child process; it runs until ``close`` (or until its parent dies). Call it from a long-lived
        thread: the child's parent-death signal fires when the *thread* that started it exits."""
        if self._process is not None:
            raise RuntimeError("the uploader was already started")
        self.config.log_file.parent.mkdir(parents=True, exist_ok=True)
        # spawn re-imports the parent's __main__ in the child: the worker's entry point keeps torch imports lazy
        # (launcher.WORKER_ENTRY), and this module imports no torch, so the light process stays light.
        context = multiprocessing.get_context("spawn")
        self._jobs = context.Queue()  # unbounded in count: the worker bounds the staged bytes
        self._results = context.Queue()
        # Daemonic: if the worker exits without close(), the uploader is stopped rather than orphaned; what it had
        # not recorded stays staged for the next run.
        self._process = context.Process(
            target=_child_main,
            args=(self.config, self._jobs, self._results),
            name="hsextract-uploader",
            daemon=True,
        )
        self._started_at = time.time()
        self._process.start()

    def submit(self, path: Path, key: str, crc32: int | None = None) -> None:
        """Queue a complete staged file for upload to ``key``; the uploader deletes it once it is recorded. ``crc32``
        is the file's as its writer wrote it: the bytes uploaded must have it."""
        if self._closed:
            raise RuntimeError("submit() after close()")
        self.check_alive()
        self._jobs.put((str(path), key, crc32))

    def poll_done(self) -> list[str]:
        """Keys recorded done in the output (staged file deleted) since the last call; never blocks.

        Still answers after ``UploaderDied``, with the keys the child confirmed before it stopped.
        """
        self._drain_results()
        done, self._unreported = self._unreported, []
        return done

    def _drain_results(self) -> None:
        while True:
            try:
                kind, value = self._results.get_nowait()
            except queue.Empty:
                return
            if kind == "done":
                self._unreported.append(value)
                self._heartbeat_at = time.time()  # a finished upload is as good a sign of life as a heartbeat
            elif kind == "heartbeat":
                self._heartbeat_at = value
            else:
                self._error = value

    def check_alive(self) -> None:
        """Raise ``UploaderDied`` if the child exited without being closed."""
        if self._process is None:
            raise RuntimeError("the uploader was not started")
        if not self._closed and self._process.exitcode is not None:
            self._raise_died()

    def close(self, timeout: float | None = None) -> list[str]:
        """Wait until every submitted file is uploaded, stop the child, and return the keys not yet polled.

        Raises ``UploaderDied`` if the child died or a file failed for good, ``HsextractError`` if it did not finish
        within ``timeout`` seconds (the child is then killed; unfinished files stay staged).
        """
        if self._process is None:
            raise RuntimeError("the uploader was not started")
        if self._closed:
            return self.poll_done()
        self.check_alive()
        self._jobs.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        # The child cannot exit before its result messages are read out of the pipe: drain while waiting.
        while self._process.exitcode is None:
            self._drain_results()
            self._process.join(0.1)
            if deadline is not None and time.monotonic() > deadline and self._process.exitcode is None:
                self._process.kill()
                self._process.join()
                self._jobs.cancel_join_thread()
                raise HsextractError(
                    f"the uploader did not finish within {timeout:.0f} s and was stopped; unfinished batches stay "
                    f"staged for the next run. See {self.config.log_file}"
                )
        self._drain_results()
        if self._process.exitcode != 0:
            self._raise_died()
        self._closed = True
        self._jobs.close()
        self._jobs.join_thread()
        return self.poll_done()

    def kill(self) -> None:
        """Stop the child at once (its worker was told to stop). What it has not recorded stays staged, and a file
        it was copying is discarded by the next run, as after any crash. SIGKILL because a stopped (SIGSTOP)
        process handles no other signal."""
        if self._process is None or self._closed:
            return
        self._closed = True
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join(10)
        self._jobs.cancel_join_thread()

    def _raise_died(self) -> None:
        self._drain_results()  # picks up the child's last message, if it sent one
        # Queued jobs can no longer be delivered; do not let them block this process's exit.
        self._jobs.cancel_join_thread()
        code = self._process.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        if code < 0 and -code in signal.valid_signals():
            how = f"was killed by {signal.Signals(-code).name}"
        reason = f": {self._error}" if self._error else ""
        raise UploaderDied(
            f"the uploader process {how}{reason}. Batches not yet uploaded stay staged and are uploaded by the next "
            f"run. Its log: {self.config.log_file}"
        )


def _child_main(config: UploaderConfig, jobs: multiprocessing.Queue, results: multiprocessing.Queue) -> None:
    from hsextract.errors import install_redaction

    die_with_parent(config.parent_pid)  # also exits at once if the parent died before the request took effect
    install_redaction()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker stops its uploader (see the module docstring)
    beating = threading.Event()
    threading.Thread(target=_send_heartbeats, args=(results, beating), name="heartbeat", daemon=True).start()
    _log_to_file(config.log_file)
    log.info(
        "uploader started: pid %d, output %s, concurrency %d", os.getpid(), config.output, config.concurrency
    )
    if "torch" in sys.modules:
        log.warning(
            "torch was imported into the uploader (through the parent's __main__ module); it costs memory"
        )
    try:
        sink = open_sink(config.output, config.endpoint_url, retry_deadline_s=config.retry_deadline_s)
        # No `with`: on a failure the process exits at once instead of waiting for uploads stuck in retries.
        pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="upload")
        _serve(config, sink, pool, jobs, results)
        pool.shutdown()
    except Exception as e:
        # HsextractErrors are worded for the user (a full file system too: a log that cannot be written); anything
        # else is a bug, logged with its traceback.
        e = disk_full(e) or e
        if isinstance(e, HsextractError):
            log.error("stopping: %s", e)
        else:
            log.exception("stopping on an unexpected error")
        results.put(("error", redact(str(e)) or type(e).__name__))
        _exit_now(results, 1)
    beating.set()
    log.info("uploader finished")
    logging.shutdown()


def _send_heartbeats(results: multiprocessing.Queue, stop: threading.Event) -> None:
    results.put(("heartbeat", time.time()))
    while not stop.wait(HEARTBEAT_S):
        try:
            results.put(("heartbeat", time.time()))
        except (ValueError, OSError):  # the queue was closed: the process is exiting
            return


def _serve(
    config: UploaderConfig,
    sink: Sink,
    pool: ThreadPoolExecutor,
    jobs: multiprocessing.Queue,
    results: multiprocessing.Queue,
) -> None:
    """Feed jobs to the pool until the None sentinel, then wait for them; raise the first upload failure."""
    in_flight: set[Future] = set()
    while True:
        finished = {f for f in in_flight if f.done()}
        for future in finished:
            future.result()  # raises the failure of that upload, which ends the process
        in_flight -= finished
        try:
            job = jobs.get(timeout=_POLL_S)
        except queue.Empty:
            _exit_if_orphaned(config, results)
            continue
        if job is None:
            break
        path, key, crc32 = job
        in_flight.add(pool.submit(_upload_one, sink, config, Path(path), key, crc32, results))
    while in_flight:
        finished, in_flight = wait(in_flight, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
        for future in finished:
            future.result()
        _exit_if_orphaned(config, results)


def _upload_one(
    sink: Sink,
    config: UploaderConfig,
    path: Path,
    key: str,
    crc32: int | None,
    results: multiprocessing.Queue,
) -> None:
    if config.plan_hash:
        # Read for every file, not once: the claim can change under a running job (the output handed to another),
        # and this check is what stops the uploads as soon as it does. One small read beside a file of many MB.
        check_claim(sink, config.plan_hash)
    start = time.monotonic()
    try:
        head = read_file_head(path)
    except HsextractError as e:
        # Recorded without a header checksum: finalize then finds the record lacking and the batch recomputed.
        head = None
        log.warning("%s: %s; its completion record holds no header checksum", key, e)
    try:
        stored = sink.put_file(path, key, expected_crc32=crc32)
    except StagedFileChanged as e:
        path.unlink(missing_ok=True)
        raise StagedFileChanged(
            f"{e}; deleted from staging, so that rerunning the same command recomputes {key}"
        ) from None
    seconds = time.monotonic() - start
    if config.plan_hash:
        write_done(sink, stored_record(stored, sink.url, head), config.plan_hash)
    path.unlink()  # only after the record: a crash in between leaves a done batch's copy, which resume deletes
    log.info(
        "uploaded %s: %d bytes in %.2f s (%.1f MB/s)",
        key,
        stored.size,
        seconds,
        stored.size / 1e6 / max(seconds, 1e-9),
    )
    results.put(("done", key))


def _exit_if_orphaned(config: UploaderConfig, results: multiprocessing.Queue) -> None:
    if os.getppid() != config.parent_pid:
        log.error(
            "the worker process %d is gone; stopping, unfinished batches stay staged", config.parent_pid
        )
        _exit_now(results, 3)


def _exit_now(results: multiprocessing.Queue, status: int) -> None:
    """Exit without waiting for upload threads that may be stuck in retries; flush what can be flushed first."""
    results.close()
    # join_thread waits until queued messages are in the pipe, which blocks while the parent does not read.
    flusher = threading.Thread(target=results.join_thread, daemon=True)
    flusher.start()
    flusher.join(timeout=5)
    logging.shutdown()
    os._exit(status)


def _log_to_file(log_file: Path) -> None:
    log_to_file(log_file, "%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    # botocore and urllib3 are chatty at INFO; their warnings (e.g. a full connection pool) still show.
    for name in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
