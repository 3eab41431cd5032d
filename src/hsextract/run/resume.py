"""What a shard has left to do when its worker starts: the output decides what is done, staging what to upload.

A batch is done only if the output's completion record says so and the object is there as recorded; nothing in
the run dir is asked. Staged files cut short, done already, of another plan or failing their header's checksums
are deleted; the complete ones left are uploaded, not recomputed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hsextract.errors import CorruptOutputError, HsextractError
from hsextract.output import BatchSpec, read_metadata
from hsextract.output.ledger import check_file, shard_name, verified_done
from hsextract.storage.local import LocalSink

log = logging.getLogger(__name__)


def done_in_output(sink, shard: int, by_key: dict[str, BatchSpec], plan_hash: str) -> list[str]:
    """The keys of ``shard``'s batches the output records done for this plan and bears out, sorted."""
    good, problems = verified_done(sink, f"{shard_name(shard)}/", by_key, plan_hash)
    if problems:
        key, why = sorted(problems.items())[0]
        log.warning(
            "%d batch(es) recorded done in the output are not (e.g. %s: %s): recomputed",
            len(problems),
            key,
            why,
        )
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
