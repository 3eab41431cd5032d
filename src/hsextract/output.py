"""The output format: what a batch file's metadata says, and the manifest that makes an output complete.

An output (a local directory or ``s3://bucket/prefix``) holds:

- ``shard-SSSSS/batch-BBBBBB.safetensors``: one file per batch (key format in rundir.py, bytes by writer.py);
- ``hsextract/job.json``: the claim. Created only if absent (a conditional put on S3), before any batch is
  written; it names the job (plan hash, fingerprint, shards, nodes) and who started it. A run whose plan differs is
  refused, and every uploader checks it before each upload, so two jobs can never mix in one output;
- ``hsextract/plan.json``, ``run.json``, ``sample_ids.json``, ``data_report.json``: what finishing the output
  needs, so that any node, or ``hsextract finalize OUTPUT``, can write the manifest without a run dir;
- ``hsextract/done/<batch key>.json``: one completion record per durable batch (size, CRC32), written by the
  uploader after the upload is verified. Progress and completion are visible from the output alone;
- ``manifest.json``: written last, once every planned batch has a completion record AND its object was checked to
  exist with that size and checksum: an output with a manifest is complete. docs/FORMAT.md describes it all.

Each batch file carries run-wide metadata (layer ids and their convention, model, dtype, tokenizer and plan
hashes) and its own identity (batch id, shard, sample ids), so a file read alone still says what it holds. The
manifest lists every batch with its sample ids in plan order; the reader maps sample ids to files through it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from . import __version__
from .errors import HsextractError

MANIFEST = "manifest.json"
JOB = "hsextract/job.json"
JOB_FILES = {
    "plan": "hsextract/plan.json",
    "info": "hsextract/run.json",
    "samples": "hsextract/sample_ids.json",
    "data_report": "hsextract/data_report.json",
}
"""What any node, or ``hsextract finalize``, needs to finish the output without a run dir (finalize.py)."""
DONE_PREFIX = "hsextract/done/"
BATCH_FORMAT = "hsextract-batch"
BATCH_FORMAT_VERSION = "1"
OUTPUT_FORMAT = "hsextract-output"
OUTPUT_FORMAT_VERSION = 1
CONVENTION = "output_of_decoder_layer"
"""Layer id k is the OUTPUT of decoder layer k (0-based), before the final norm: HF output_hidden_states[k + 1]."""


def run_file_metadata(
    *,
    layer_ids,
    model: str,
    model_revision: str,
    model_config_hash: str,
    dtype: str,
    hidden_size: int,
    tokenizer_hash: str,
    chat_template_hash: str,
    plan_hash: str,
    kernels: str,
) -> dict[str, str]:
    """The run-wide part of every batch file's metadata."""
    return {
        "layer_ids": json.dumps(list(layer_ids)),
        "layer_convention": CONVENTION,
        "hf_output_hidden_states_index": json.dumps([k + 1 for k in layer_ids]),
        "pre_final_norm": "true",
        "model": model,
        "model_revision": model_revision,
        "model_config_hash": model_config_hash,
        "dtype": dtype,
        "hidden_size": str(hidden_size),
        "tokenizer_hash": tokenizer_hash,
        "chat_template_hash": chat_template_hash,
        "plan_hash": plan_hash,
        "kernels": kernels,
        "hsextract_version": __version__,
    }


def batch_metadata(*, run_meta: dict, batch_id: int, shard: int, sample_ids: list[str]) -> dict[str, str]:
    """The per-file metadata: run-wide fields plus this batch's identity."""
    meta = {k: str(v) for k, v in run_meta.items()}
    meta.update(
        format=BATCH_FORMAT,
        format_version=BATCH_FORMAT_VERSION,
        batch_id=str(batch_id),
        shard=str(shard),
        sample_ids=json.dumps(sample_ids),
    )
    return meta


def bytes_per_token(num_layers: int, hidden: int, itemsize: int) -> int:
    """States of every captured layer, plus the token id (int32) and its loss-mask byte."""
    return num_layers * hidden * itemsize + 4 + 1


def estimate_file_bytes(
    num_tokens: int, num_samples: int, num_layers: int, hidden: int, itemsize: int
) -> int:
    """Bytes of a batch file's tensors (the header adds a few KB)."""
    return (
        num_tokens * bytes_per_token(num_layers, hidden, itemsize) + (num_samples + 1) * 8 + num_samples * 8
    )


def build_manifest(*, info, plan, dtype: str, sample_ids: list[str], data_report: dict) -> dict:
    """The manifest of a finished run: run-wide facts and every batch with its sample ids, in plan order."""
    return {
        "format": OUTPUT_FORMAT,
        "format_version": OUTPUT_FORMAT_VERSION,
        "hsextract_version": __version__,
        "layer_ids": list(info.layer_ids),
        "layer_convention": CONVENTION,
        "layer_types": list(info.layer_types),
        "hidden_size": info.hidden_size,
        "dtype": dtype,
        "plan_hash": plan.plan_hash,
        "fingerprint": plan.fingerprint,
        "num_samples": plan.num_samples,
        "num_tokens": plan.num_tokens,
        "data_report": data_report,
        "batches": [
            {
                "key": b.key,
                "batch_id": b.batch_id,
                "shard": b.shard,
                "num_tokens": b.num_tokens,
                "sample_ids": [sample_ids[i] for i in b.sample_indices],
            }
            for b in plan.batches
        ],
    }


def write_manifest(sink, manifest: dict) -> None:
    sink.put_bytes(MANIFEST, json.dumps(manifest).encode())


def has_manifest(sink) -> bool:
    return sink.exists(MANIFEST)


def delete_manifest(sink) -> None:
    sink.delete(MANIFEST)


def read_manifest(sink) -> dict:
    """The manifest of the output behind ``sink``; a clear error if there is none or it is unreadable."""
    if not sink.exists(MANIFEST):
        raise HsextractError(
            f"{sink.url} has no {MANIFEST}: the run has not finished (see `hsextract status RUN_DIR`) "
            "or this is not an hsextract output"
        )
    try:
        manifest = json.loads(sink.get_bytes(MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HsextractError(
            f"{sink.url}/{MANIFEST} is not valid JSON ({e}); the output is damaged"
        ) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("batches"), list):
        raise HsextractError(f"{sink.url}/{MANIFEST} has no batch list; the output is damaged")
    return manifest


# -- the claim ------------------------------------------------------------------------------------------------------
def job_record(*, plan, nodes: int, run_dir: str, host: str) -> dict:
    return {
        "plan_hash": plan.plan_hash,
        "shards": plan.shards,
        "nodes": nodes,
        "fingerprint": plan.fingerprint,
        "started_by": {"run_dir": run_dir, "host": host, "time": time.time()},
    }


def read_job(sink) -> dict | None:
    try:
        return json.loads(sink.get_bytes(JOB))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HsextractError(
            f"{sink.url}/{JOB} is damaged ({e}); delete it only if no run writes there"
        ) from None


def claim_output(sink, job: dict) -> dict:
    """Make ``job`` the output's job if it has none (atomically: of two racing runs exactly one wins); returns
    the job in force, which the caller compares with its own."""
    if sink.put_bytes_if_absent(JOB, json.dumps(job, indent=2).encode()):
        return job
    held = read_job(sink)
    if held is None:  # deleted between our attempt and the read: try once more
        return (
            job if sink.put_bytes_if_absent(JOB, json.dumps(job, indent=2).encode()) else read_job(sink) or {}
        )
    return held


def describe_job(job: dict) -> str:
    who = job.get("started_by", {})
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(who.get("time", 0)))
    return f"plan {job.get('plan_hash')}, started from run dir {who.get('run_dir')} on {who.get('host')} at {when}"


def check_claim(sink, plan_hash: str) -> None:
    """Raise unless the output is still claimed by the job with ``plan_hash`` (uploaders call it per file)."""
    job = read_job(sink)
    if job is None or job.get("plan_hash") != plan_hash:
        held = "no job at all" if job is None else f"another job ({describe_job(job)})"
        raise HsextractError(
            f"output {sink.url} is now held by {held}, not this run's plan {plan_hash}: stopped so that two jobs "
            "never mix in one output"
        )


def publish_job_files(sink, files: dict[str, object]) -> None:
    """Put the job files next to the claim, each only if absent: every node of a job computes the same ones."""
    for name, value in files.items():
        sink.put_bytes_if_absent(JOB_FILES[name], json.dumps(value).encode())


# -- completion records ---------------------------------------------------------------------------------------------
def done_key(key: str) -> str:
    return f"{DONE_PREFIX}{key}.json"


def write_done(sink, stored, plan_hash: str) -> None:
    """Record a verified batch in the output. Deterministic content: a recomputed batch writes the same bytes."""
    record = {"key": stored.key, "size": stored.size, "crc32": stored.crc32, "plan_hash": plan_hash}
    sink.put_bytes(done_key(stored.key), json.dumps(record, sort_keys=True).encode())


def done_in_output(sink, prefix: str = "") -> set[str]:
    """Batch keys with a completion record in the output (one listing; ``prefix`` e.g. ``shard-00003/``)."""
    return {
        k[len(DONE_PREFIX) : -len(".json")]
        for k in sink.list_keys(DONE_PREFIX + prefix)
        if k.endswith(".json")
    }


def check_batches(sink, keys, plan_hash: str, workers: int = 16) -> dict[str, str]:
    """For each batch key: its completion record exists, matches this plan, and the object is there with the
    recorded size and (where the store keeps one) CRC32. Returns ``{key: what is wrong}`` for the bad ones."""

    def check(key: str) -> str | None:
        try:
            record = json.loads(sink.get_bytes(done_key(key)))
        except FileNotFoundError:
            return "no completion record"
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "damaged completion record"
        if record.get("plan_hash") != plan_hash:
            return f"completion record of another plan ({record.get('plan_hash')})"
        stored = sink.stored(key)
        if stored is None:
            return "batch file missing"
        if stored.size != record["size"]:
            return f"batch file has {stored.size} bytes, {record['size']} were uploaded"
        if stored.crc32 is not None and record.get("crc32") is not None and stored.crc32 != record["crc32"]:
            return f"batch file CRC32 {stored.crc32:08x}, {record['crc32']:08x} was uploaded"
        return None

    keys = list(keys)
    with ThreadPoolExecutor(max(1, min(workers, len(keys)))) as pool:
        problems = dict(zip(keys, pool.map(check, keys), strict=True))
    return {k: v for k, v in problems.items() if v}
