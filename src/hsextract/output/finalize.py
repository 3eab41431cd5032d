"""Finishing an output from the output alone: the manifest once every batch of the whole job is durable.

Every node (and ``hsextract finalize OUTPUT``) runs the same steps, so the manifest is written by whichever finishes
last, and a lost run dir loses nothing:

1. the job files (plan, run info, sample ids, data report) that preparation published next to the claim;
2. the completion records: a batch without one is still to do (another node's, or a crashed one's);
3. every batch checked against its record (exists, same size, same CRC32 where the store keeps it): a batch
   deleted or damaged behind the run's back loses its record and is reported, never listed in a manifest;
4. the sample index (output/sample_index.py: every sample's file, row, tokens and id, and which samples each
   trainer's schema leaves out), from each batch file's header and index tensors, so that a trainer indexes the
   output with one read instead of two per batch file;
5. the manifest, built only from the plan and the sample ids, so every node builds the same bytes (the index
   too): two nodes finishing at once write the same objects, which makes the race harmless.

``status.rows.output_status`` reads the same files for ``hsextract status OUTPUT``.
"""

from __future__ import annotations

import json

from hsextract.errors import HsextractError
from hsextract.output.final_norm import read_final_norm_meta
from hsextract.output.manifest import build_manifest, delete_manifest, has_manifest, write_manifest
from hsextract.output.records import JOB_FILES, RunInfo, check_batches, done_in_output, done_key
from hsextract.prepare.plan import Plan


def load_job_files(sink) -> tuple[Plan, RunInfo, list[str], dict]:
    plan, info = load_plan(sink)
    return plan, info, _job_file(sink, "samples"), _job_file(sink, "data_report")


def load_plan(sink) -> tuple[Plan, RunInfo]:
    """The job's plan and run info alone (status needs no sample ids: ~20 MB of JSON at 1M samples)."""
    plan = Plan.from_json(_job_file(sink, "plan"), where=f"{sink.url}/{JOB_FILES['plan']}")
    info = RunInfo.from_json(_job_file(sink, "info"), where=f"{sink.url}/{JOB_FILES['info']}")
    return plan, info


def _job_file(sink, name: str):
    def get(name: str):
        try:
            return json.loads(sink.get_bytes(JOB_FILES[name]))
        except FileNotFoundError:
            raise HsextractError(
                f"{sink.url} has no {JOB_FILES[name]}: not an hsextract output, or its first node has not "
                "finished preparing yet"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HsextractError(f"{sink.url}/{JOB_FILES[name]} is damaged ({e})") from None

    return get(name)


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


def finalize_output(sink, *, write_index, echo=print) -> tuple[int, set[str]]:
    """Write the manifest if every planned batch is done and checked. Returns the exit code (0 also while batches
    are still to do: another node's, or a crashed shard's) and the keys of every batch not done: without a
    completion record, or found missing or damaged (their records are removed so that their shards recompute
    them). An empty set means the manifest is written and every batch it lists was checked just before.

    ``write_index(sink, manifest)`` writes the sample index (``training.index.write_sample_index``): it records
    which samples each trainer's schema leaves out, which the trainers know and the output does not."""
    plan, info, sample_ids, data_report = load_job_files(sink)
    keys = [b.key for b in plan.batches]
    done = done_in_output(sink)
    todo = {k for k in keys if k not in done}
    if todo:
        _withdraw_manifest(sink, echo)
        shards = sorted({b.shard for b in plan.batches if b.key in todo})
        echo(f"{len(todo)} of {len(keys)} batches still to do (shards {shards}); no manifest written yet")
        return 0, todo
    # The full check: on a store that keeps no CRC32 (a local output) each file is read once to compute it.
    problems, records = check_batches(sink, keys, plan.plan_hash, full=True)
    if problems:
        return _damaged(sink, problems, len(keys), echo)
    # Written even over a manifest already there: built from the plan and the records just checked, it is the
    # same bytes on every node, and one edited or left by an earlier attempt is replaced by one that holds.
    final_norm = read_final_norm_meta(sink) if info.final_state else None
    manifest = job_manifest((plan, info, sample_ids, data_report), records, final_norm)
    # The training loader's sample index (two small reads per batch file, once per job), written before the manifest
    # that records its checksum.
    entry, unreadable = write_index(sink, manifest)
    if unreadable:
        return _damaged(sink, {k: e.problem for k, e in unreadable.items()}, len(keys), echo)
    manifest["sample_index"] = entry
    write_manifest(sink, manifest)
    echo(
        f"done: {plan.num_samples} samples, {plan.num_tokens} tokens in {len(keys)} batch files at {sink.url}"
    )
    return 0, set()
