"""The per-shard worker: what is left, the model, the pipeline, the uploader process.

One process per shard (``main`` with RUN_DIR SHARD). ``ShardRun`` locks the shard, works out what is left
(resume.py: done is what the output records and bears out), starts the uploader and the monitor, loads the model
and runs the pipeline over the remaining batches, whose writer thread stages each file within the budget for the
uploader. SIGTERM or SIGINT stop the shard: what is not recorded stays staged, and it exits with 128 + the signal.
"""

# Complete staged files are uploaded, not recomputed (resume.py). The monitor (monitor.py) ticks, names stalls and
# rewrites the progress file; the writer is writer.StagingWriter. On a stop the uploader is killed (what it has not
# recorded stays staged) and the progress file says ``stopped``.

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

from hsextract.config import RunConfig
from hsextract.errors import HsextractError, disk_full, install_redaction, redact
from hsextract.model.capture import model_final_norm
from hsextract.model.load import load_model_for, torch_device
from hsextract.output import BatchSpec, Plan
from hsextract.output.ledger import RunInfo, shard_name
from hsextract.prepare.tokenfile import TokenizedSamples
from hsextract.run.monitor import ShardMonitor
from hsextract.run.pipeline import Extractor
from hsextract.run.procs import Stopped, Terminated, log_to_file, stop_on_signals
from hsextract.run.progress import ShardProgress
from hsextract.run.resume import done_in_output, recover_staging
from hsextract.run.rundir import RunDir
from hsextract.run.uploader import Uploader
from hsextract.run.writer import StagingWriter
from hsextract.startup import fast_load, ready
from hsextract.storage import open_sink

log = logging.getLogger(__name__)


class ShardRun:
    """Everything one shard does, from resume bookkeeping to the last recorded upload."""

    def __init__(self, run_dir: Path, shard: int):
        self.run_dir = RunDir(run_dir)
        self.shard = shard
        self.cfg = RunConfig.load(self.run_dir.config_file)
        self.info = RunInfo.load(self.run_dir)
        self.plan = Plan.load(self.run_dir.plan_file)
        self.batches = self.plan.for_shard(shard)
        self.by_key = {b.key: b for b in self.batches}
        self.staging = self.cfg.staging_dir / shard_name(shard)
        self.stopping = threading.Event()
        """Set by a stop signal or by a failure the monitor met: the pipeline and its writer stop waiting."""
        self.stop_signum = signal.SIGTERM
        progress = ShardProgress(
            shard=shard,
            pid=os.getpid(),
            host=socket.gethostname(),
            batches_total=len(self.batches),
            samples_total=sum(b.rows for b in self.batches),
            tokens_total=sum(b.num_tokens for b in self.batches),
            stall_timeout_s=self.cfg.stall_timeout_s,
        )
        self.monitor = ShardMonitor(self.run_dir, progress, self.batches, self.staging, self.stopping)
        self.uploader: Uploader | None = None
        self.locked = False
        self.stops_at_checks = False
        """While the pipeline's threads run: a stop signal sets ``stopping`` and the main thread raises ``Stopped``
        at its next check, never mid-way through a queue's or the monitor's lock."""

    def run(self) -> None:
        self._lock_file = self.run_dir.lock_shard(self.shard)  # held while this file object lives
        self.locked = True
        progress = self.monitor.progress
        progress.keep_room(self.run_dir)
        previous = ShardProgress.load(self.run_dir, self.shard)
        if previous is not None:  # the rate history goes on across restarts; the gap shows the downtime
            progress.history, progress.history_step_s = previous.history, previous.history_step_s
        log.info(
            "shard %d: %d batches, %d tokens; staging %s",
            self.shard,
            len(self.batches),
            progress.tokens_total,
            self.staging,
        )
        sink = open_sink(self.cfg.output, self.cfg.s3_endpoint_url)
        done = done_in_output(sink, self.shard, self.by_key, self.plan.plan_hash)
        self.monitor.count_done(done, this_session=False)
        staged = recover_staging(self.staging, self.shard, set(done), self.by_key, self.plan.plan_hash)
        if len(done) < len(self.batches):
            # A killed uploader can leave a half-copied file (local) or an open multipart upload (S3) in the output.
            partials = sink.discard_partials(f"{shard_name(self.shard)}/")
            if partials:
                log.info(
                    "discarded %d unfinished upload(s) left in the output by an earlier attempt", partials
                )
        todo = [b for b in self.batches if b.key not in done and b.key not in staged]
        log.info(
            "resume: %d batches done, %d staged to upload, %d to compute", len(done), len(staged), len(todo)
        )
        self.monitor.save("starting")

        self.uploader = Uploader(
            output=self.cfg.output,
            endpoint_url=self.cfg.s3_endpoint_url,
            log_file=self.run_dir.log_file(self.shard, "uploader"),
            plan_hash=self.plan.plan_hash,
        )
        # From here on a failure leaves the uploader to die with this process (parent-death signal); staged files
        # stay for the rerun.
        self.uploader.start()
        progress.uploader_pid = self.uploader.pid
        samples = TokenizedSamples.load(self.run_dir.tokens_file) if todo else None  # proves itself
        if samples is not None:
            samples.check_ids_below(
                self.info.vocab_size, "the token file changed after preparation; rerun the same command"
            )
        writer = StagingWriter(
            self.staging,
            int(self.cfg.staging_max_gb * 1e9),
            self.uploader,
            file_metadata=self.info.file_metadata,
            sample_ids=samples.sample_ids if samples else [],
            stop=self.stopping,
        )
        for key, crc32 in staged.items():
            writer.submit(self.staging / Path(key).name, key, crc32)
        self.monitor.start(self.uploader, writer)
        try:
            if todo:
                self._compute(todo, samples, writer)
            self.stops_at_checks = True
            self.monitor.running("draining")
            self.monitor.save()
            while not self.monitor.all_done:
                self.monitor.check()
                if self.stopping.is_set():
                    raise Stopped
                time.sleep(0.1)
        except Stopped:
            self.monitor.check()  # the failure that stopped the pipeline
            raise Terminated(self.stop_signum) from None
        finally:
            self.stops_at_checks = False
            self.monitor.halt()
        self.monitor.check()
        self.monitor.count_done(self.uploader.close())
        self.uploader = None
        progress.uploader_pid, progress.uploader_heartbeat_at = 0, None
        self.monitor.save("done", last=True)
        try:
            self.staging.rmdir()  # empty now: every staged file was uploaded and removed
        except OSError:
            pass
        log.info("shard %d done", self.shard)

    def _compute(self, todo: list[BatchSpec], samples: TokenizedSamples, writer: StagingWriter) -> None:
        cfg = self.cfg
        device = torch_device(cfg)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        t0 = time.time()
        self.monitor.save("loading")
        lm = load_model_for(cfg, device, fast_load)
        log.info("model loaded in %.1f s", time.time() - t0)
        ready(device, on_wait=lambda: self.monitor.save("waiting-for-kernels"))
        layout = self.info.layout
        if layout.final_state:
            # Every shard writes the same bytes; the manifest needs the file, and any finished batch implies it.
            model_final_norm(lm).write(open_sink(cfg.output, cfg.s3_endpoint_url))
        extractor = Extractor(
            lm,
            layout.slot_layers,
            device=device,
            max_tokens=max(b.num_tokens for b in todo),
            num_slots=cfg.pinned_buffers,
            pad_token_id=self.info.pad_token_id,
            storage_dtype=layout.storage_dtype,
            check_states=cfg.check_states,
            target_topk=layout.target_topk,
            share_prefixes=cfg.share_prefixes,
        )
        if cfg.rows == "per-turn":
            log.info(
                "per-turn rows: %s",
                "each shared prefix computed once (stock forward, row by row)"
                if cfg.share_prefixes
                else f"each row computed whole (the {cfg.kernel_mode} kernels keep no cache)",
            )
        self.monitor.running("running")
        self.monitor.save()
        self.stops_at_checks = True
        if self.stopping.is_set():  # a stop signal before this line raised; one after it is seen by the loop
            raise Stopped
        extractor.run(todo, samples, writer, stop=self.stopping)


def main(argv=None) -> int:
    install_redaction()
    argv = sys.argv[1:] if argv is None else argv
    run_dir, shard = Path(argv[0]), int(argv[1])
    log_to_file(RunDir(run_dir).log_file(shard))
    shard_run = None
    stop_signal: list[int] = []
    stop_on_signals(
        on_stop=lambda signum: _note_stop(signum, stop_signal, shard_run),
        deferred=lambda: shard_run is not None and shard_run.stops_at_checks,
    )
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
        shard_run.monitor.progress.error = message
        shard_run.monitor.save(state, last=True)
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
