"""What a shard has left to do when its worker starts: the output decides what is done, staging what to upload.

- ``sync_with_output``: a batch is done only if the output records it for this plan and holds the object as
  recorded (``records.verified_done``; under a launcher, as it checked them just before starting the workers). Markers in the run dir are a cache of that: a missing one is written back
  (a run dir lost, a rerun on another node); one the output does not bear out (the output deleted, replaced or
  damaged behind the run) is dropped and its batch recomputed.
- ``recover_staging``: writes cut short (``*.tmp-*``) are deleted, and so is every staged file that is done
  already, not this plan's, or whose bytes do not match the checksums its writer put in its header; the complete
  ones left are uploaded, not recomputed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from hsextract.errors import CorruptOutputError, HsextractError
from hsextract.format.keys import shard_name
from hsextract.format.records import verified_done
from hsextract.prepare.plan import BatchSpec
from hsextract.run.rundir import OUTPUT_CHECK_ENV, RunDir
from hsextract.run.writer import read_metadata
from hsextract.storage.fileio import atomic_write
from hsextract.storage.local import LocalSink
from hsextract.verify import check_file

log = logging.getLogger(__name__)


def sync_with_output(
    sink, run_dir: RunDir, shard: int, by_key: dict[str, BatchSpec], plan_hash: str
) -> list[str]:
    """The keys of ``shard``'s batches the output records done and bears out, sorted; the markers made to agree.
    Under a launcher, its check of the output made just before is taken (each record is read once)."""
    checked = run_dir.load_output_check(plan_hash, shard) if os.environ.get(OUTPUT_CHECK_ENV) else None
    if checked is None:
        good, problems = verified_done(sink, f"{shard_name(shard)}/", by_key, plan_hash)
    else:
        good, problems = ({k: v for k, v in part.items() if k in by_key} for part in checked)
        log.info("the output's completion records as the launcher checked them: %d batch(es) done", len(good))
    markers = {k for k in run_dir.done_keys() if k in by_key}
    if stale := sorted(markers - set(good)):
        for key in stale:
            run_dir.marker(key).unlink(missing_ok=True)
        why = problems.get(stale[0], "no completion record")
        log.warning(
            "%d batch(es) with a marker are not done in the output (e.g. %s: %s): recomputed",
            len(stale),
            stale[0],
            why,
        )
    for key in set(good) - markers:
        atomic_write(run_dir.marker(key), json.dumps(good[key]))
    return sorted(good)


def recover_staging(
    staging: Path, shard: int, done: set[str], by_key: dict[str, BatchSpec], plan_hash: str
) -> dict[str, int]:
    """Drop cut-short writes and files that are not this plan's; return ``{key: CRC32}`` of the complete staged
    files that still need uploading. A staged file is trusted only if its own header names this plan and its key
    and its bytes match the header's checksums; the CRC32 is of the bytes so checked, for the uploader to check
    the bytes it sends against."""
    staging.mkdir(parents=True, exist_ok=True)
    pending = {}
    for entry in sorted(os.scandir(staging), key=lambda e: e.name):
        key = f"{shard_name(shard)}/{entry.name}"
        if ".tmp" in entry.name:  # a write cut short: temporary names hold .tmp
            os.unlink(entry.path)
            log.info("discarded partial staged file %s", entry.name)
        elif key in done or key not in by_key:
            os.unlink(entry.path)
        elif isinstance(checked := staged_file_check(Path(entry.path), by_key[key], plan_hash), str):
            os.unlink(entry.path)
            log.warning("discarded staged file %s: %s; it will be recomputed", entry.name, checked)
        else:
            pending[key] = checked
    return pending


def staged_file_check(path: Path, batch: BatchSpec, plan_hash: str) -> int | str:
    """The CRC32 of a staged file whose header proves it is this plan's ``batch`` and whose bytes match its
    checksums; else why it does not belong (a string)."""
    try:
        meta = read_metadata(path)
    except (OSError, HsextractError) as e:
        return f"unreadable header ({e})"
    if meta.get("plan_hash") != plan_hash:
        return f"written for another plan ({meta.get('plan_hash')})"
    if (meta.get("shard"), meta.get("batch_id")) != (str(batch.shard), str(batch.batch_id)):
        return f"holds shard {meta.get('shard')} batch {meta.get('batch_id')}"
    # Every byte against the checksums the writer put in its header: a file truncated or altered after a
    # crash is recomputed, never uploaded (its record would then vouch for the damaged bytes).
    try:
        return check_file(LocalSink(path.parent), {"key": path.name, "size": path.stat().st_size})
    except CorruptOutputError as e:
        return e.problem
