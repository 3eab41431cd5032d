"""NeMo Automodel's DSpark offline cache written from an output (``--format nemo-dspark``).

The files are what its reader (``CachedTensorDataset``, ``CachedDSparkDataset``) and recipe read: docs/EXPORT.md.
Shards are written in sample order, each under its final name at once, so a rerun skips those there;
``manifest.json`` comes last with ``complete: true``. A shard is built in memory, hence the small default
``shard_size``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from hsextract.errors import HsextractError

CACHE_FORMAT_VERSION = 1


DEFAULT_SHARD_SIZE = 16


NEMO_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

"""NeMo's ``DTYPE_MAP`` names; fp8 outputs are dequantized to bfloat16 (its cache holds no scales)."""


def shard_key(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def write_cache(dest, index, reader, *, seq_length: int, shard_size: int, threads: int, progress) -> int:
    """Every sample ``index`` serves (its schema a ``NemoDSpark`` of ``seq_length``), in order, into shards of
    ``shard_size``; the manifest last. Returns the samples written."""
    if shard_size < 1:
        raise HsextractError(f"--shard-size must be at least 1, got {shard_size}")
    schema = index.schema
    total = len(index)
    shards = (total + shard_size - 1) // shard_size
    todo = [j for j in range(shards) if not dest.exists(shard_key(j))]
    progress(total - sum(min(shard_size, total - j * shard_size) for j in todo))
    for j in todo:
        first, stop = j * shard_size, min(total, (j + 1) * shard_size)
        items = list(
            reader.stream(
                list(range(first, stop)),
                lambda i, s: schema.item(schema.record(s)),
                threads=threads,
                prefetch=max(threads, 4),
            )
        )
        _put_shard(dest, shard_key(j), {k: torch.stack([item[k] for item in items]) for k in schema.KEYS})
        progress(stop - first)
    manifest = cache_manifest(index, seq_length=seq_length, shard_size=shard_size)
    dest.put_bytes("manifest.json", json.dumps(manifest, indent=2, sort_keys=True).encode())
    return total


def _put_shard(dest, key: str, tensors: dict) -> None:
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="hsextract-nemo-") as tmp:
        path = Path(tmp) / key
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        dest.put_file(path, key)


def cache_manifest(index, *, seq_length: int, shard_size: int) -> dict:
    """The fields NeMo's ``build_cache_manifest`` writes: those that describe the tensors and the target, and those
    that describe its own tokenization of a JSONL file (``train_data_path``...) saying where the data came from."""
    m = index.manifest
    fp = m.get("fingerprint") or {}
    hidden, ids = int(m["hidden_size"]), list(index.layer_ids)
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "complete": True,
        "target_model": fp.get("model", ""),
        "target_model_type": target_model_type(fp.get("model", "")),
        "target_vocab_size": m.get("vocab_size"),
        "hidden_size": hidden,
        "num_hidden_layers": m.get("num_layers"),
        "seq_length": seq_length,
        "dtype": NEMO_DTYPES["bfloat16" if m.get("storage_dtype") else m["dtype"]],
        "num_samples": len(index),
        "shard_size": shard_size,
        "target_hidden_dim": hidden * len(ids),
        "target_last_hidden_dim": hidden,
        "target_layer_ids": ids,
        "train_data_path": f"hsextract output (plan {m.get('plan_hash')})",
        "train_split": None,
        "shuffle_seed": 0,
        "mask_reasoning_content": False,
        "chat_template_sha256": fp.get("chat_template_hash", ""),
    }


def target_model_type(model: str) -> str:
    """The target's ``model_type`` (NeMo checks it), from its config.json where it can be read."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            return str(json.load(f).get("model_type", ""))
    except (OSError, ValueError):
        pass
    try:
        from transformers import AutoConfig

        return str(AutoConfig.from_pretrained(model).model_type)
    except Exception:  # a hub id not cached here: the manifest says so, NeMo's check names the value
        return ""
