"""``StagingWriter``: the pipeline's writer-thread end. Each batch's file (output/writer.py) goes into the shard's
staging directory within its budget, then to the uploader.

Written in the writer thread, from the pinned host tensors, overlapped with the GPU's next forward; the checksums
and the CRC32 the uploader checks its upload against are computed there, the last moment the bytes are known good.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path

import torch

from hsextract.errors import HsextractError
from hsextract.output import BatchSpec, batch_metadata, write_batch_file
from hsextract.run.procs import Stopped
from hsextract.run.rundir import scan_staging

log = logging.getLogger(__name__)


class StagingWriter:
    """Each batch's file into the shard's staging directory, then to the uploader, within the staging budget.

    Called in the pipeline's writer thread. While the staged bytes would pass ``budget`` it waits (``waiting``):
    the pipeline's slots then stop coming back and the GPU waits too, instead of filling /dev/shm, until the
    uploader drains staging. ``stop`` ends a wait (``Stopped``)."""

    def __init__(
        self,
        staging: Path,
        budget: int,
        uploader,
        *,
        file_metadata: dict,
        sample_ids: list[str],
        stop: threading.Event,
    ):
        self.staging, self.budget, self.uploader = Path(staging), budget, uploader
        self.file_metadata, self.sample_ids, self.stop = file_metadata, sample_ids, stop
        self.waiting = False
        """Waiting for the uploader to drain staging."""
        self.written_at: float | None = None
        """When the last batch file was written."""
        self.submitted: set[str] = set()
        """Keys handed to the uploader."""

    def submit(self, path: Path, key: str, crc32: int) -> None:
        """Hand a complete staged file to the uploader (also those a crashed run left, resume.recover_staging)."""
        self.submitted.add(key)
        self.uploader.submit(path, key, crc32)

    def __call__(self, batch: BatchSpec, tensors: dict[str, torch.Tensor]) -> None:
        self._wait_for_budget(sum(t.numel() * t.element_size() for t in tensors.values()))
        meta = batch_metadata(
            run_meta=self.file_metadata,
            batch_id=batch.batch_id,
            shard=batch.shard,
            sample_ids=[self.sample_ids[i] for i in batch.sample_indices],
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
        self.written_at = time.time()
        log.info(
            "batch %d written: %d rows, %d tokens, %.1f MB in %.3f s",
            batch.batch_id,
            batch.rows,
            batch.num_tokens,
            size / 1e6,
            time.perf_counter() - t0,
        )
        self.submit(path, batch.key, crc32)

    def _wait_for_budget(self, need: int) -> None:
        while (staged := scan_staging(self.staging).bytes) and staged + need > self.budget:
            if not self.waiting:
                log.info(
                    "staging holds %.2f GB (budget %.2f GB): waiting for the uploader",
                    staged / 1e9,
                    self.budget / 1e9,
                )
                self.waiting = True
            if self.stop.wait(0.05):
                raise Stopped
        if self.waiting:
            self.waiting = False
            log.info("staging drained; continuing")
