"""Finishing an output from the output alone: the manifest once every batch of the whole job is durable.

Every node (and ``hsextract finalize OUTPUT``) runs the same steps, so whichever finishes last writes the manifest
and a lost run dir loses nothing: the job files, the completion records, every batch checked against its record
(a damaged one loses its record, never enters a manifest), then the manifest, built only from the plan and the
sample ids, so that two nodes finishing at once write the same bytes.
"""

from __future__ import annotations

from hsextract.container import read_head
from hsextract.errors import HsextractError
from hsextract.output.final_norm import FinalNorm
from hsextract.output.jobfiles import load_job_files
from hsextract.output.keys import parse_batch_key
from hsextract.output.manifest import (
    STORED_FIELDS,
    build_manifest,
    delete_manifest,
    has_manifest,
    read_manifest,
    write_manifest,
)
from hsextract.output.records import (
    JOB_FILES,
    check_batches,
    done_in_output,
    done_key,
    stored_record,
    write_done,
)
from hsextract.storage.base import StoredObject, removed_temps_note


def job_manifest(job, stored: dict[str, dict], final_norm: dict | None = None) -> dict:
    """The manifest of the job ``load_job_files`` read, with ``stored`` for each batch (output/manifest.py)."""
    plan, info, sample_ids, data_report = job
    return build_manifest(
        info=info,
        plan=plan,
        dtype=plan.fingerprint.get("dtype", ""),
        sample_ids=sample_ids,
        data_report=data_report,
        stored=stored,
        final_norm=final_norm,
    )


def live_manifest(sink) -> dict | None:
    """The manifest of the output behind ``sink`` if it has one, else one built from its job files with no batch
    recorded yet (entries without size or checksums); None while the job files are not all there."""
    if has_manifest(sink):
        return read_manifest(sink)
    if not all(sink.exists(key) for key in JOB_FILES.values()):
        return None
    job = load_job_files(sink)
    manifest = job_manifest(job, {b.key: dict.fromkeys(STORED_FIELDS) for b in job[0].batches})
    for entry in manifest["batches"]:
        for field in STORED_FIELDS:
            del entry[field]
    return manifest


def _withdraw_manifest(sink, echo) -> None:
    """A manifest over batches that are not all done and sound no longer holds: removed, so that no reader or
    trainer takes the output as complete until the batches are recomputed and a new one is written."""
    if has_manifest(sink):
        delete_manifest(sink)
        echo("the manifest no longer holds; removed until the batches above are recomputed")


def _damaged(sink, problems: dict[str, str], planned: int, echo) -> tuple[int, set[str]]:
    """Batch files found missing or damaged: reported, their records removed so that their shards recompute them."""
    for key, why in sorted(problems.items())[:10]:
        echo(f"output check: {key}: {why}")
    echo(f"{len(problems)} of {planned} batch files are missing or damaged in {sink.url}")
    _withdraw_manifest(sink, echo)  # first: an output with a manifest says it is complete
    for key in problems:
        sink.delete(done_key(key))
    return 1, set(problems)


RECORD_PROBLEMS = ("its completion record", "completion record of another plan")

"""Problems of a completion record itself (it does not prove itself, lacks the file's checksums, or names another
plan than the claim's): the file decides."""


def _rewrite_sound_records(sink, problems: dict[str, str], plan_hash: str, echo) -> dict[str, str]:
    """Where a batch's completion record is the problem, the file decides: one sound by its own header and checksums
    that names this plan and its batch gets its record written again from it; the rest are returned."""
    left = {}
    for key, why in problems.items():
        record = _own_record(sink, key, plan_hash) if why.startswith(RECORD_PROBLEMS) else None
        if record is None:
            left[key] = why
        else:
            write_done(sink, record, plan_hash)
            echo(f"output check: {key}: {why}; recorded again from its file, which is sound")
    return left


def _refuse_if_sound(sink, problems: dict[str, str], plan_hash: str) -> None:
    """Headers that contradict the manifest built from the job files: a file sound by its own header and checksums
    that names this plan and its batch makes the job files the suspect. Refused naming them; nothing touched."""
    for key, why in sorted(problems.items()):
        if _own_record(sink, key, plan_hash) is not None:
            raise HsextractError(
                f"batch file {sink.url}/{key} is sound by its own header and checksums but disagrees with the job "
                f"files ({why}): {sink.url}/hsextract/ (plan.json, run.json, sample_ids.json) was edited or "
                "damaged; nothing was changed. Restore it, or rerun the job's command with --restart"
            )


def _own_record(sink, key: str, plan_hash: str) -> dict | None:
    """The completion record the batch file at ``key`` earns on its own: its header names this plan, its shard
    and batch id, and its bytes match its header's checksums (``check_file``); None if it does not."""
    from hsextract.output.verify import check_file

    shard, batch_id = parse_batch_key(key)
    try:
        size = sink.size(key)
        crc = check_file(
            sink,
            {"key": key, "size": size},
            expect={"plan_hash": plan_hash, "shard": shard, "batch_id": batch_id},
        )
        head = read_head(lambda o, n: sink.read_range(key, o, n), HsextractError)
    except (FileNotFoundError, IsADirectoryError, HsextractError):  # CorruptOutputError is one
        return None
    return stored_record(StoredObject(key, size, crc), sink.url, head)


def ready_manifest(sink, echo=print) -> tuple[int, set[str], dict | None]:
    """Steps 1 to 3: the manifest to write once the sample index is (``write_final_manifest``), if every planned
    batch is done and checked. Returns the exit code (0 also while batches are still to do: another node's, or a
    crashed shard's), the keys of every batch not done: without a completion record, or found missing or damaged
    (their records are removed so that their shards recompute them), and the manifest, None unless that set is
    empty."""
    plan, info, sample_ids, data_report = load_job_files(sink)
    keys = [b.key for b in plan.batches]
    done = done_in_output(sink)
    todo = {k for k in keys if k not in done}
    if todo:
        _withdraw_manifest(sink, echo)
        shards = sorted({b.shard for b in plan.batches if b.key in todo})
        echo(f"{len(todo)} of {len(keys)} batches still to do (shards {shards}); no manifest written yet")
        return 0, todo, None
    if note := removed_temps_note(sink.remove_stale_temps()):  # a killed uploader's, its writer gone
        echo(note)
    # The full check: on a store that keeps no CRC32 (a local output) each file is read once to compute it.
    problems, records = check_batches(sink, keys, plan.plan_hash, full=True)
    if problems and not _rewrite_sound_records(sink, problems, plan.plan_hash, echo):
        problems, records = check_batches(sink, keys, plan.plan_hash)
    if problems:
        return (*_damaged(sink, problems, len(keys), echo), None)
    # Written even over a manifest already there: built from the plan and the records just checked, it is the
    # same bytes on every node, and one edited or left by an earlier attempt is replaced by one that holds.
    final_norm = FinalNorm.read_meta(sink) if info.final_state else None
    return 0, set(), job_manifest((plan, info, sample_ids, data_report), records, final_norm)


def write_final_manifest(
    sink, manifest: dict, index_entry: dict | None, unreadable: dict, echo=print
) -> tuple[int, set[str]]:
    """Step 5, once the sample index is written (its ``index_entry``; ``unreadable``: ``{key: CorruptOutputError}``
    for the batch files it could not read, which are then reported as damaged and no manifest is written). Returns
    the exit code and the keys of the batches found damaged (empty: the manifest is written)."""
    if unreadable:
        problems = {k: e.problem for k, e in unreadable.items()}
        _refuse_if_sound(sink, problems, manifest["plan_hash"])
        return _damaged(sink, problems, len(manifest["batches"]), echo)
    manifest["sample_index"] = index_entry
    write_manifest(sink, manifest)
    echo(
        f"done: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens in {len(manifest['batches'])} "
        f"batch files at {sink.url}"
    )
    return 0, set()
