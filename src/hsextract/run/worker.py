"""The per-shard worker: the GPU pipeline, files to staging, the uploader process.

One process per shard (``main`` with RUN_DIR SHARD), started by the launcher with ``CUDA_VISIBLE_DEVICES``
already set. ``ShardRun`` locks the shard, works out what is left (resume.py: done is what the output records and
bears out; complete staged files are uploaded, not recomputed), loads the model and drives the pipeline
(pipeline.py) over the remaining batches. Its writer callback writes each batch file into the staging directory
and hands it to the uploader process (uploader.py), which records it done in the output once it is durable.

Backpressure: the writer waits while the shard's staged bytes exceed ``staging_max_gb``; the pipeline's slots then
stop coming back and the GPU waits too, without failing, until the uploader drains the staging directory.

Heartbeats and stalls: the main thread ``_tick``s at least every second, also while it waits (for a free slot,
for staging space, for the last uploads; a helper thread ticks for it through blocking calls such as the model
load): it reads the uploader's messages, looks for a stall and rewrites the progress file, which is therefore the
worker's own heartbeat (progress.py). A stall (the uploader silent for ``stall_timeout_s``, or no batch written or
uploaded for that long) is logged once when it starts and once when it ends, and recorded in the progress file
for the launcher and ``status``. Nothing is stopped: a stall may end (a slow endpoint, a process continued).

SIGTERM or SIGINT stop the shard: the uploader is killed (what it has not recorded stays staged), the progress file
says ``stopped`` by that signal, and the process exits with 128 + the signal number. A rerun resumes.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from hsextract.config import RunConfig
from hsextract.errors import HsextractError, disk_full, redact
from hsextract.format.batch import batch_metadata
from hsextract.format.final_norm import write_final_norm
from hsextract.format.keys import shard_name
from hsextract.model.capture import model_final_norm
from hsextract.model.load import load_model_for, torch_device
from hsextract.model.tuned import install_here as install_tuned
from hsextract.prepare.plan import BatchSpec, Plan
from hsextract.prepare.tokenize import TokenizedSamples
from hsextract.run.pipeline import Extractor
from hsextract.run.prewarm import wait_for_warmup, warmup_pending
from hsextract.run.procs import Terminated, log_to_file, stop_on_signals
from hsextract.run.progress import ShardProgress
from hsextract.run.resume import done_in_output, recover_staging
from hsextract.run.rundir import RunDir, RunInfo, scan_staging
from hsextract.run.stalls import Stall, same_stall, stall_note, worker_stall
from hsextract.run.uploader import Uploader
from hsextract.run.writer import write_batch_file
from hsextract.storage import open_sink

log = logging.getLogger(__name__)


REFRESH_S = 0.5

"""The progress file is rewritten when it is this old at a tick; ticks come at least every 0.5 s (the pipeline's
wait for a slot, the drain loop, the helper thread), so it is never more than about a second old."""


class ShardRun:
    """Everything one shard does, from resume bookkeeping to the last confirmed upload."""

    def __init__(self, run_dir: Path, shard: int):
        self.run_dir = RunDir(run_dir)
        self.shard = shard
        self.cfg = RunConfig.load(self.run_dir.config_file)
        self.info = RunInfo.load(self.run_dir)
        self.plan = Plan.load(self.run_dir.plan_file)
        self.batches = self.plan.for_shard(shard)
        self.by_key = {b.key: b for b in self.batches}
        self.staging = self.cfg.staging_dir / shard_name(shard)
        self.budget = int(self.cfg.staging_max_gb * 1e9)
        self.progress = ShardProgress(
            shard=shard,
            pid=os.getpid(),
            host=socket.gethostname(),
            batches_total=len(self.batches),
            samples_total=sum(b.rows for b in self.batches),
            tokens_total=sum(b.num_tokens for b in self.batches),
            stall_timeout_s=self.cfg.stall_timeout_s,
        )
        self.done: set[str] = set()
        self.submitted: set[str] = set()
        self.session_tokens = 0
        self.t_start = time.time()
        self.uploader: Uploader | None = None
        self.locked = False
        self.stopping = threading.Event()
        """Set by a stop signal: the writer thread gives up waiting for staging space."""
        self.stop_signum = signal.SIGTERM
        self._saved_at = 0.0
        self._idle_from = time.time()
        """Start of the current stretch in which a batch is expected (running, draining)."""
        self._stall: Stall | None = None

    # -- progress -------------------------------------------------------------------------------------------
    def _count_done(self, keys) -> None:
        for key in keys:
            if key in self.by_key and key not in self.done:
                self.done.add(key)
                b = self.by_key[key]
                self.progress.batches_done += 1
                self.progress.samples_done += b.rows
                self.progress.tokens_done += b.num_tokens
                self.progress.progress_at = time.time()
                self.session_tokens += b.num_tokens

    def _save_progress(self, state: str | None = None, *, last: bool = False) -> None:
        if state:
            self.progress.state = state
        elapsed = max(time.time() - self.t_start, 1e-6)
        p = self.progress
        p.tokens_per_s = self.session_tokens / elapsed
        p.samples_per_s = p.tokens_per_s * (p.samples_total / max(p.tokens_total, 1))
        remaining = p.tokens_total - p.tokens_done
        p.eta_s = remaining / p.tokens_per_s if p.tokens_per_s > 0 else None
        try:
            p.staged_bytes = scan_staging(self.staging).bytes
        except FileNotFoundError:
            p.staged_bytes = 0
        if last:  # how the shard ended: saved even on a full run dir, if at all possible
            p.save_last(self.run_dir)
        else:
            p.save(self.run_dir)

    def _poll_uploader(self) -> None:
        self.uploader.check_alive()
        self._count_done(self.uploader.poll_done())
        self.progress.uploader_heartbeat_at = self.uploader.heartbeat_at

    def _tick(self, *_) -> None:
        """Hear from the uploader, look for a stall, refresh the progress file if it is due. At least every
        second, from the main thread (or the helper thread of ``_ticking``, while the main thread is blocked)."""
        if self.uploader is not None:
            self._poll_uploader()
        now = time.time()
        if now - self._saved_at >= REFRESH_S:
            self._check_stall(now)
            self._save_progress()
            self._saved_at = now

    @contextmanager
    def _ticking(self, state: str):
        """Tick from a helper thread while the main thread is in a long blocking call (loading the model)."""
        self._save_progress(state)
        done = threading.Event()

        def tick():
            while not done.wait(REFRESH_S / 2):
                try:
                    self._tick()
                except Exception:  # the main thread meets the same failure at its next tick
                    return

        thread = threading.Thread(target=tick, name="progress-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _check_stall(self, now: float) -> None:
        """Name the stalled process, if any (``stalls.worker_stall``), in the log and the progress file; log a
        stall that ended as recovered."""
        up = self.uploader
        stall, since = worker_stall(
            now=now,
            timeout=self.cfg.stall_timeout_s,
            state=self.progress.state,
            batches_left=len(self.batches) - len(self.done),
            last_progress_at=max(self.progress.progress_at or 0.0, self._idle_from),
            uploads_waiting=len(self.submitted - self.done),
            uploader_pid=up.pid if up is not None else None,
            uploader_heartbeat_at=up.heartbeat_at if up is not None else None,
            worker_pid=os.getpid(),
        )
        if same_stall(stall, self._stall):
            return
        if self._stall is not None:
            old = self._stall
            log.info(
                "shard %d: %s pid %d recovered after %.0f s",
                self.shard,
                old.process,
                old.pid,
                now - old.since,
            )
        if stall is not None:
            note = stall_note(stall.pid) if stall.pid != os.getpid() else ""
            log.warning(
                "shard %d: %s pid %d stalled: %s for %.0f s (stall timeout %g s)%s",
                *(
                    self.shard,
                    stall.process,
                    stall.pid,
                    stall.reason,
                    now - since,
                    self.cfg.stall_timeout_s,
                    note,
                ),
            )
        self._stall = stall
        p = self.progress
        p.stalled_process, p.stalled_pid, p.stall_reason = (
            (stall.process, stall.pid, stall.reason) if stall else ("", 0, "")
        )
        p.stalled_since = since if stall else None

    # -- staging ----------------------------------------------------------------------------------------------
    def _wait_for_budget(self, need: int) -> None:
        waited = False
        while True:
            staged = scan_staging(self.staging).bytes
            if staged == 0 or staged + need <= self.budget:
                break
            if not waited:
                log.info(
                    "staging holds %.2f GB (budget %.2f GB): waiting for the uploader",
                    staged / 1e9,
                    self.budget / 1e9,
                )
                self.progress.state = "waiting-for-uploader"
                waited = True
            self.uploader.check_alive()
            if self.stopping.is_set():
                raise Terminated(self.stop_signum)
            time.sleep(0.05)
        if waited:
            self.progress.state = "running"
            log.info("staging drained; continuing")

    def _write_batch(self, batch: BatchSpec, tensors: dict) -> None:
        """Writer thread: file into staging (tmp + rename), then to the uploader."""
        self._wait_for_budget(sum(t.numel() * t.element_size() for t in tensors.values()))
        sample_ids = [self.sample_ids[i] for i in batch.sample_indices]
        meta = batch_metadata(
            run_meta=self.info.file_metadata,
            batch_id=batch.batch_id,
            shard=batch.shard,
            sample_ids=sample_ids,
        )
        path = self.staging / Path(batch.key).name
        t0 = time.perf_counter()
        try:
            size, crc32 = write_batch_file(path, tensors, meta)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise HsextractError(
                f"staging directory {self.staging} is full (no space left on device) while writing {path.name}: "
                "free space there or lower --staging-max-gb, then rerun the same command to resume"
            ) from None
        self.progress.progress_at = time.time()
        log.info(
            "batch %d written: %d rows, %d tokens, %.1f MB in %.3f s",
            batch.batch_id,
            batch.rows,
            batch.num_tokens,
            size / 1e6,
            time.perf_counter() - t0,
        )
        self._submit(path, batch.key, crc32)

    def _submit(self, path: Path, key: str, crc32: int) -> None:
        self.submitted.add(key)
        self.uploader.submit(path, key, crc32)

    # -- main -------------------------------------------------------------------------------------------------
    def _lock_shard(self) -> None:
        self._lock_file = self.run_dir.lock_shard(self.shard)
        self.locked = True
        self.progress.keep_room(self.run_dir)

    def run(self) -> None:
        self._lock_shard()
        previous = ShardProgress.load(self.run_dir, self.shard)
        if previous is not None:  # the rate history goes on across restarts; the gap shows the downtime
            self.progress.history, self.progress.history_step_s = previous.history, previous.history_step_s
        log.info(
            "shard %d: %d batches, %d tokens; staging %s",
            self.shard,
            len(self.batches),
            self.progress.tokens_total,
            self.staging,
        )  # noqa: E501
        sink = open_sink(self.cfg.output, self.cfg.s3_endpoint_url)
        self._count_done(done_in_output(sink, self.shard, self.by_key, self.plan.plan_hash))
        self.session_tokens = 0
        staged = recover_staging(self.staging, self.shard, self.done, self.by_key, self.plan.plan_hash)
        if len(self.done) < len(self.batches):
            # A killed uploader can leave a half-copied file (local) or an open multipart upload (S3) in the output.
            partials = sink.discard_partials(f"{shard_name(self.shard)}/")
            if partials:
                log.info(
                    "discarded %d unfinished upload(s) left in the output by an earlier attempt", partials
                )
        todo = [b for b in self.batches if b.key not in self.done and b.key not in staged]
        log.info(
            "resume: %d batches done, %d staged to upload, %d to compute",
            len(self.done),
            len(staged),
            len(todo),
        )
        self._save_progress("starting")

        self.uploader = Uploader(
            output=self.cfg.output,
            endpoint_url=self.cfg.s3_endpoint_url,
            log_file=self.run_dir.log_file(self.shard, "uploader"),
            plan_hash=self.plan.plan_hash,
        )
        # From here on a failure leaves the uploader to die with this process (parent-death signal); staged files
        # stay for the rerun.
        self.uploader.start()
        self.progress.uploader_pid = self.uploader.pid
        for key, crc32 in staged.items():
            self._submit(self.staging / Path(key).name, key, crc32)
        if todo:
            self._compute(todo)
        self._save_progress("draining")
        self._idle_from = time.time()
        while len(self.done) < len(self.batches):
            self._tick()
            time.sleep(0.1)
        self._check_stall(time.time())  # a stall that ended within the last refresh is logged as recovered
        self._count_done(self.uploader.close())
        self.uploader = None
        self.progress.uploader_pid, self.progress.uploader_heartbeat_at = 0, None
        self._save_progress("done", last=True)
        try:
            self.staging.rmdir()  # empty now: every staged file was uploaded and removed
        except OSError:
            pass
        log.info("shard %d done", self.shard)

    def _compute(self, todo: list[BatchSpec]) -> None:
        cfg = self.cfg
        samples = TokenizedSamples.load(self.run_dir.tokens_file)
        self.sample_ids = samples.sample_ids
        device = torch_device(cfg)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        t0 = time.time()
        with self._ticking("loading"):
            lm = load_model_for(cfg, device)
        log.info("model loaded in %.1f s", time.time() - t0)
        if warmup_pending():  # the kernel warm-up runs beside the load: its kernels before the first batch
            with self._ticking("waiting-for-kernels"):
                wait_for_warmup()
            install_tuned()  # what the warm-up chose and recorded
        layout = self.info.layout
        if layout.final_state:
            # Every shard writes the same bytes; the manifest needs the file, and any finished batch implies it.
            write_final_norm(open_sink(cfg.output, cfg.s3_endpoint_url), model_final_norm(lm))
        extractor = Extractor(
            lm,
            layout.slot_layers,
            device=device,
            max_tokens=max(b.num_tokens for b in todo),
            num_slots=cfg.pinned_buffers,
            pad_token_id=self.info.pad_token_id,
            storage_dtype=layout.storage_dtype,
            check_states=cfg.check_states,
        )
        self.t_start = self._idle_from = time.time()
        self._save_progress("running")
        # Both callbacks run in this thread: after each forward, and every 0.5 s while it waits for a free slot.
        extractor.run(todo, samples, self._write_batch, on_forward=self._tick, should_stop=self._tick)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, shard = Path(argv[0]), int(argv[1])
    log_to_file(RunDir(run_dir).log_file(shard))
    shard_run = None
    stop_signal: list[int] = []
    stop_on_signals(on_stop=lambda signum: _note_stop(signum, stop_signal, shard_run))
    state = "failed"
    try:
        shard_run = ShardRun(run_dir, shard)
        shard_run.run()
        return 0
    except Terminated as e:
        code, message, state = e.exit_code, str(e), "stopped"
    except BaseException as e:
        if not stop_signal:
            code, message = _failure(shard, disk_full(e, where=run_dir) or e)
        else:  # a failure caused by the stop itself (the uploader got the group's SIGTERM first)
            e = Terminated(stop_signal[0])
            code, message, state = e.exit_code, str(e), "stopped"
    if state == "stopped":
        log.warning("shard %d %s; finished batches are kept, unfinished ones stay staged", shard, message)
        _say(f"shard {shard}: {message}")
    if shard_run is not None and shard_run.uploader is not None:
        shard_run.uploader.kill()
    # Only the process holding the shard's lock may write its progress (another may be running it right now).
    if shard_run is not None and shard_run.locked:
        shard_run.progress.error = message
        shard_run._save_progress(state, last=True)
    return code


def _note_stop(signum: int, stop_signal: list[int], shard_run: ShardRun | None) -> None:
    stop_signal.append(signum)
    if shard_run is not None:
        shard_run.stop_signum = signum
        shard_run.stopping.set()


def _failure(shard: int, e: BaseException) -> tuple[int, str]:
    """Log and print why the shard failed; the exit code and the message its progress file records."""
    if isinstance(e, HsextractError):
        log.error("%s", e)
        _say(f"shard {shard}: {e}")
        return 2, str(e)
    log.error("shard %d failed", shard, exc_info=e)
    message = redact(repr(e))
    _say(f"shard {shard} failed: {message}")
    return 1, message


def _say(line: str) -> None:
    """A line on stderr (the run dir's ``.stderr.log``), unless that file system is full: the progress file,
    saved last, is what the launcher and ``status`` read."""
    try:
        print(line, file=sys.stderr)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
