"""The per-shard worker: padded batches through the hooked model, copies overlapped with compute, files to staging.

One process per shard (``main`` with RUN_DIR SHARD; ``python -m hsextract.worker RUN_DIR SHARD`` by hand, but then
``spawn`` imports this module, and torch, into the uploader too), started by the launcher with
``CUDA_VISIBLE_DEVICES`` already set. The GPU never waits for host work:

1. The main thread builds a padded batch, runs the forward; the hooks gather the captured layers' valid tokens
   into a device buffer laid out as the file stores them ([tokens, layers, hidden]).
2. A side CUDA stream copies that buffer into a reused pinned host buffer as soon as the forward is done, while
   the main thread already launches the next batch.
3. A writer thread waits for the copy, writes the safetensors file into the staging directory (temporary name,
   then rename) straight from the pinned buffer, and hands it to the uploader process.

A fixed set of buffer slots (``pinned_buffers``) bounds host and device memory and how far the GPU runs ahead.
Backpressure: the writer waits while the shard's staged bytes exceed ``staging_max_gb``; slots then stop coming
back and the GPU loop waits too, without failing, until the uploader drains the staging directory.

Resume: batches with a marker are skipped; complete files left in staging are uploaded, not recomputed;
``*.tmp`` files (a write cut short) are deleted.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .capture import GatherTarget, LayerCapture, load_model
from .config import RunConfig
from .data import TokenizedSamples
from .errors import HsextractError
from .plan import BatchSpec, Plan
from .progress import ShardProgress, done_keys, lock_path, log_path, markers_dir
from .storage import open_sink
from .uploader import Uploader
from .writer import batch_metadata, write_safetensors

log = logging.getLogger("hsextract.worker")


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [rows, padded_length] int64, right-padded
    attention_mask: torch.Tensor  # [rows, padded_length] int64
    flat_index: torch.Tensor  # [tokens] positions of valid tokens in the flattened batch
    tokens_ids: torch.Tensor  # [tokens] int32, what the file stores
    tokens_mask: torch.Tensor  # [tokens] uint8
    cu_seqlens: torch.Tensor  # [rows + 1] int64
    sample_index: torch.Tensor  # [rows] int64

    @property
    def num_tokens(self) -> int:
        return int(self.flat_index.numel())


def build_batch(samples: TokenizedSamples, batch: BatchSpec, pad_token_id: int) -> BatchInputs:
    """Right-padded rows and the index of their valid tokens. Padding on the right keeps every valid token's
    state equal to the unpadded forward's (causal attention and the linear-attention recurrence never see it)."""
    rows, width = batch.rows, batch.padded_length
    ids = np.full((rows, width), pad_token_id, dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.int64)
    lengths = np.empty(rows, dtype=np.int64)
    flat_ids, flat_mask, flat_index = [], [], []
    for r, i in enumerate(batch.sample_indices):
        s_ids, s_mask = samples.sample(i)
        n = len(s_ids)
        ids[r, :n] = s_ids
        mask[r, :n] = 1
        lengths[r] = n
        flat_ids.append(s_ids)
        flat_mask.append(s_mask)
        flat_index.append(np.arange(r * width, r * width + n, dtype=np.int64))
    cu = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return BatchInputs(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(mask),
        flat_index=torch.from_numpy(np.concatenate(flat_index)),
        tokens_ids=torch.from_numpy(np.concatenate(flat_ids).astype(np.int32)),
        tokens_mask=torch.from_numpy(np.concatenate(flat_mask).astype(np.uint8)),
        cu_seqlens=torch.from_numpy(cu),
        sample_index=torch.tensor(batch.sample_indices, dtype=torch.int64),
    )


class _Slot:
    """A device gather buffer and the host buffer its contents are copied to (the same tensor on CPU)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.device_buf = torch.empty(numel, dtype=dtype, device=device)
        if device.type == "cuda":
            self.host_buf = torch.empty(numel, dtype=dtype, pin_memory=True)
            self.copied = torch.cuda.Event()
        else:
            self.host_buf = self.device_buf
            self.copied = None


class Extractor:
    """Runs batches through the hooked model and hands each batch's tensors, on the host, to ``on_batch``
    in a writer thread, overlapping the copy and the write with the next forward."""

    def __init__(
        self,
        lm,
        layer_ids,
        *,
        device: torch.device,
        max_tokens: int,
        num_slots: int,
        pad_token_id: int,
        _shift: int = 0,
    ):
        # ``_shift`` only lets the dry run's tests prove that a capture off by one layer is caught.
        self._shift = _shift
        self.lm = lm
        self.layer_ids = tuple(layer_ids)
        self.device = device
        self.pad_token_id = pad_token_id
        self.hidden = lm.config.get_text_config().hidden_size
        self.dtype = next(lm.parameters()).dtype
        numel = max_tokens * len(self.layer_ids) * self.hidden
        self.slots = [_Slot(numel, self.dtype, device) for _ in range(num_slots)]
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, batches, samples: TokenizedSamples, on_batch, on_forward=None, should_stop=None):
        """``on_batch(batch, tensors)`` runs in the writer thread; its tensors alias a slot that is reused once it
        returns. ``on_forward(batch, seconds)`` runs in this thread after each forward is launched."""
        free: queue.Queue = queue.Queue()
        for s in self.slots:
            free.put(s)
        work: queue.Queue = queue.Queue()
        failure: list[BaseException] = []

        def writer():
            while (item := work.get()) is not None:
                slot, batch, inputs = item
                try:
                    if failure:
                        continue
                    if slot.copied is not None:
                        slot.copied.synchronize()
                    n = inputs.num_tokens
                    states = slot.host_buf[: n * len(self.layer_ids) * self.hidden].view(
                        n, len(self.layer_ids), self.hidden
                    )
                    on_batch(
                        batch,
                        {
                            "hidden_states": states,
                            "input_ids": inputs.tokens_ids,
                            "loss_mask": inputs.tokens_mask,
                            "cu_seqlens": inputs.cu_seqlens,
                            "sample_index": inputs.sample_index,
                        },
                    )
                except BaseException as e:  # surfaced in the main thread
                    failure.append(e)
                finally:
                    free.put(slot)

        thread = threading.Thread(target=writer, name="batch-writer", daemon=True)
        thread.start()
        try:
            with LayerCapture(self.lm, self.layer_ids, shift=self._shift) as cap, torch.inference_mode():
                for batch in batches:
                    slot = self._take(free, failure, should_stop)
                    inputs = build_batch(samples, batch, self.pad_token_id)
                    t0 = time.perf_counter()
                    n = inputs.num_tokens
                    out = slot.device_buf[: n * len(self.layer_ids) * self.hidden].view(
                        n, len(self.layer_ids), self.hidden
                    )
                    cap.forward(
                        inputs.input_ids.to(self.device, non_blocking=True),
                        inputs.attention_mask.to(self.device, non_blocking=True),
                        GatherTarget(
                            flat_index=inputs.flat_index.to(self.device, non_blocking=True), out=out
                        ),
                    )
                    if self.copy_stream is not None:
                        # The copy waits for this forward only; the next forward starts at once on the main stream.
                        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                        with torch.cuda.stream(self.copy_stream):
                            slot.host_buf[: out.numel()].copy_(out.view(-1), non_blocking=True)
                            slot.copied.record(self.copy_stream)
                    work.put((slot, batch, inputs))
                    if on_forward is not None:
                        on_forward(batch, time.perf_counter() - t0)
        finally:
            work.put(None)
            thread.join()
        if failure:
            raise failure[0]

    @staticmethod
    def _take(free: queue.Queue, failure: list, should_stop):
        while True:
            if failure:
                raise failure[0]
            if should_stop is not None:
                should_stop()
            try:
                return free.get(timeout=0.5)
            except queue.Empty:
                continue


def staged_bytes(staging: Path) -> int:
    total = 0
    for entry in os.scandir(staging):
        if entry.name.endswith(".safetensors"):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # uploaded and removed meanwhile
                pass
    return total


def _setup_logging(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


class ShardRun:
    """Everything one shard does, from resume bookkeeping to the last confirmed upload."""

    def __init__(self, run_dir: Path, shard: int):
        self.run_dir = Path(run_dir)
        self.shard = shard
        self.cfg = RunConfig.load(self.run_dir / "config.json")
        self.meta = json.loads((self.run_dir / "run.json").read_text())
        self.plan = Plan.load(self.run_dir / "plan.json")
        self.batches = self.plan.for_shard(shard)
        self.by_key = {b.key: b for b in self.batches}
        self.staging = self.cfg.staging_dir / f"shard-{shard:05d}"
        self.budget = int(self.cfg.staging_max_gb * 1e9)
        self.progress = ShardProgress(
            shard=shard,
            pid=os.getpid(),
            host=socket.gethostname(),
            batches_total=len(self.batches),
            samples_total=sum(b.rows for b in self.batches),
            tokens_total=sum(b.num_tokens for b in self.batches),
        )
        self.done: set[str] = set()
        self.session_tokens = 0
        self.t_start = time.time()
        self.uploader: Uploader | None = None
        self.locked = False

    # -- progress -------------------------------------------------------------------------------------------
    def _mark_done(self, keys) -> None:
        for key in keys:
            if key in self.by_key and key not in self.done:
                self.done.add(key)
                b = self.by_key[key]
                self.progress.batches_done += 1
                self.progress.samples_done += b.rows
                self.progress.tokens_done += b.num_tokens
                self.session_tokens += b.num_tokens

    def _save_progress(self, state: str | None = None) -> None:
        if state:
            self.progress.state = state
        elapsed = max(time.time() - self.t_start, 1e-6)
        p = self.progress
        p.tokens_per_s = self.session_tokens / elapsed
        p.samples_per_s = p.tokens_per_s * (p.samples_total / max(p.tokens_total, 1))
        remaining = p.tokens_total - p.tokens_done
        p.eta_s = remaining / p.tokens_per_s if p.tokens_per_s > 0 else None
        try:
            p.staged_bytes = staged_bytes(self.staging)
        except FileNotFoundError:
            p.staged_bytes = 0
        p.save(self.run_dir)

    def _poll_uploader(self) -> None:
        self.uploader.check_alive()
        self._mark_done(self.uploader.poll_done())

    # -- staging ----------------------------------------------------------------------------------------------
    def _recover_staging(self) -> list[str]:
        """Drop cut-short writes; return keys of complete staged files that still need uploading."""
        self.staging.mkdir(parents=True, exist_ok=True)
        pending = []
        for entry in sorted(os.scandir(self.staging), key=lambda e: e.name):
            key = f"shard-{self.shard:05d}/{entry.name}"
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)
                log.info("discarded partial staged file %s", entry.name)
            elif key in self.done or key not in self.by_key:
                os.unlink(entry.path)
            else:
                pending.append(key)
        return pending

    def _wait_for_budget(self, need: int) -> None:
        waited = False
        while True:
            staged = staged_bytes(self.staging)
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
            time.sleep(0.05)
        if waited:
            self.progress.state = "running"
            log.info("staging drained; continuing")

    def _write_batch(self, batch: BatchSpec, tensors: dict) -> None:
        """Writer thread: file into staging (tmp + rename), then to the uploader."""
        hs = tensors["hidden_states"]
        self._wait_for_budget(hs.numel() * hs.element_size())
        sample_ids = [self.sample_ids[i] for i in batch.sample_indices]
        meta = batch_metadata(
            run_meta=self.meta["file_metadata"],
            batch_id=batch.batch_id,
            shard=batch.shard,
            sample_ids=sample_ids,
        )
        path = self.staging / Path(batch.key).name
        t0 = time.perf_counter()
        size = write_safetensors(path, tensors, meta)
        log.info(
            "batch %d written: %d rows, %d tokens, %.1f MB in %.3f s",
            batch.batch_id,
            batch.rows,
            batch.num_tokens,
            size / 1e6,
            time.perf_counter() - t0,
        )
        self.uploader.submit(path, batch.key)

    # -- main -------------------------------------------------------------------------------------------------
    def _lock_shard(self) -> None:
        """Hold an exclusive lock on this shard for the life of the process: two processes running one shard
        would race on its staging directory and output keys. The kernel drops the lock when the process dies."""
        path = lock_path(self.run_dir, self.shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(path, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "another process"
            raise HsextractError(
                f"shard {self.shard} of {self.run_dir} is already being run by {holder}; "
                "wait for it (hsextract status) or stop it before rerunning"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}")
        self._lock_file.flush()
        self.locked = True

    def run(self) -> None:
        self._lock_shard()
        log.info(
            "shard %d: %d batches, %d tokens; staging %s",
            self.shard,
            len(self.batches),
            self.progress.tokens_total,
            self.staging,
        )
        all_done = done_keys(self.run_dir)
        self._mark_done(k for k in self.by_key if k in all_done)
        self.session_tokens = 0
        staged = self._recover_staging()
        if len(self.done) < len(self.batches):
            # A killed uploader can leave a half-copied file (local) or an open multipart upload (S3) in the output.
            partials = open_sink(self.cfg.output, self.cfg.s3_endpoint_url).discard_partials(
                f"shard-{self.shard:05d}/"
            )
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
            marker_dir=markers_dir(self.run_dir),
            log_file=log_path(self.run_dir, self.shard, "uploader"),
        )
        self.uploader.start()
        try:
            for key in staged:
                self.uploader.submit(self.staging / Path(key).name, key)
            if todo:
                self._compute(todo)
            self._save_progress("draining")
            while len(self.done) < len(self.batches):
                self._poll_uploader()
                self._save_progress()
                time.sleep(0.1)
            self._mark_done(self.uploader.close())
            self.uploader = None
        except BaseException:
            # The uploader is killed with this process (parent-death signal); staged files stay for the rerun.
            raise
        self._save_progress("done")
        log.info("shard %d done", self.shard)

    def _compute(self, todo: list[BatchSpec]) -> None:
        cfg = self.cfg
        samples = TokenizedSamples.load(self.run_dir / self.meta["tokens_file"])
        self.sample_ids = samples.sample_ids
        device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._save_progress("loading")
        t0 = time.time()
        lm = load_model(
            cfg.model,
            dtype=cfg.dtype,
            device=str(device),
            attn_implementation=cfg.attn_implementation,
            random_weights=cfg.random_weights,
        )
        log.info("model loaded in %.1f s", time.time() - t0)
        extractor = Extractor(
            lm,
            tuple(self.meta["layer_ids"]),
            device=device,
            max_tokens=max(b.num_tokens for b in todo),
            num_slots=cfg.pinned_buffers,
            pad_token_id=self.meta["pad_token_id"],
        )
        self.t_start = time.time()
        self._save_progress("running")
        last_save = [0.0]

        def on_forward(batch, seconds):
            self._poll_uploader()
            now = time.time()
            if now - last_save[0] > 1.0:
                self._save_progress()
                last_save[0] = now

        extractor.run(
            todo, samples, self._write_batch, on_forward=on_forward, should_stop=self._poll_uploader
        )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, shard = Path(argv[0]), int(argv[1])
    _setup_logging(log_path(run_dir, shard))
    shard_run = None
    try:
        shard_run = ShardRun(run_dir, shard)
        shard_run.run()
        return 0
    except HsextractError as e:
        log.error("%s", e)
        print(f"shard {shard}: {e}", file=sys.stderr)
        code, message = 2, str(e)
    except BaseException as e:
        log.exception("shard %d failed", shard)
        print(f"shard {shard} failed: {e!r}", file=sys.stderr)
        code, message = 1, repr(e)
    if (
        shard_run is not None and shard_run.locked
    ):  # never overwrite the progress of the process holding the shard
        shard_run.progress.error = message
        shard_run._save_progress("failed")
    return code


if __name__ == "__main__":
    sys.exit(main())
