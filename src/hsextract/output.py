"""The output format: what a batch file's metadata says, and the manifest that makes an output complete.

An output (a local directory or ``s3://bucket/prefix``) holds one safetensors file per batch under its key
(``shard-SSSSS/batch-BBBBBB.safetensors``, see rundir.py; bytes written by writer.py) and, once every batch is
durable, ``manifest.json``, written last: an output with a manifest is complete. docs/FORMAT.md describes both.

Each batch file carries run-wide metadata (layer ids and their convention, model, dtype, tokenizer and plan
hashes) and its own identity (batch id, shard, sample ids), so a file read alone still says what it holds. The
manifest lists every batch with its sample ids in plan order; the reader maps sample ids to files through it.
"""

from __future__ import annotations

import json

from . import __version__
from .errors import HsextractError

MANIFEST = "manifest.json"
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
