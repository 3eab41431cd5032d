"""A batch file's format: its metadata, its checksums, its header, and which layer each slot of its states holds.

Each batch file carries run-wide metadata and its own identity, so a file read alone says what it holds, and one
xxh3 per sample (over its rows of every per-token tensor): a reader checks a sample with the one ranged read that
fetches it. ``StateLayout`` says which captured layer each slot of ``hidden_states`` holds. docs/FORMAT.md
describes every file of an output.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from hsextract import __version__

BATCH_FORMAT = "hsextract-batch"


BATCH_FORMAT_VERSION = "3"

"""2: per-sample and index checksums in the metadata (``checksums``). 3: ``hidden_states`` holds slots (the
final state after the captured layers), fp8 values come with ``hidden_states_scale``; ``slot_layer_ids``,
``final_state_slot`` and ``storage_dtype`` in the metadata."""


INDEX_TENSORS = ("cu_seqlens", "sample_index")

"""A batch file's per-batch tensors; every other tensor is per-token (its first dimension is the token count)."""


CHECKSUMS = "checksums"

"""The metadata key of a batch file's checksums (a JSON object, see ``checksums_metadata``)."""


CHECKSUM_ALGORITHM = "xxh3_64"


CHECKSUM_CHUNK = 8 << 20

"""Bytes hashed per call: xxhash holds the GIL while it hashes, and the writer thread must not starve the
thread that launches the GPU's kernels (8 MiB is about a millisecond)."""


CONVENTION = "output_of_decoder_layer"

"""Layer id k is the OUTPUT of decoder layer k (0-based), before the final norm: HF output_hidden_states[k + 1]."""


TOPK_IDS = "target_topk_ids"

"""[tokens, K] int32: the target's K most likely next tokens after each token, most likely first."""


TOPK_LOGPROBS = "target_topk_logprobs"

"""[tokens, K] float32: their log-probabilities (log-softmax over the full vocabulary)."""


@dataclass(frozen=True)
class StateLayout:
    """What the ``hidden_states`` tensor of every batch file holds, slot by slot, and how its values are stored."""

    layer_ids: tuple[int, ...]
    """The captured decoder-layer ids, sorted."""
    num_layers: int
    final_state: bool = False
    """Whether the last decoder layer's output (before the final norm) is stored too."""
    storage_dtype: str | None = None
    """``float8_e4m3fn`` (values with a float32 scale per token per slot), or None: the run dtype."""
    target_topk: int | None = None
    """K of ``target_topk_ids`` / ``target_topk_logprobs`` [tokens, K] beside the states, or None: not stored."""

    # The names a batch file and its manifest give what the layout describes (read by the run, dry-run, status).
    CONVENTION: ClassVar[str] = CONVENTION
    TOPK_IDS: ClassVar[str] = TOPK_IDS
    TOPK_LOGPROBS: ClassVar[str] = TOPK_LOGPROBS

    @property
    def slot_layers(self) -> tuple[int, ...]:
        """The decoder layer whose output each slot holds."""
        last = self.num_layers - 1
        extra = (last,) if self.final_state and last not in self.layer_ids else ()
        return tuple(self.layer_ids) + extra

    @property
    def final_slot(self) -> int | None:
        return self.slot_layers.index(self.num_layers - 1) if self.final_state else None

    @property
    def scaled(self) -> bool:
        return self.storage_dtype is not None

    @property
    def layers_run(self) -> int:
        """Decoder layers the forward runs: to the deepest slot, or all of them for the target's top-k."""
        return self.num_layers if self.target_topk else max(self.slot_layers) + 1

    def bytes_per_token(self, hidden: int, itemsize: int) -> int:
        """Stored bytes per token: the states (``itemsize`` bytes a value unless fp8), their scales, id and mask,
        and the target's top-k."""
        if self.scaled:
            states = bytes_per_token(len(self.slot_layers), hidden, 1, scale_bytes=4)
        else:
            states = bytes_per_token(len(self.slot_layers), hidden, itemsize)
        return states + self.topk_bytes

    @property
    def topk_bytes(self) -> int:
        """Bytes per token of the target's top-k: an int32 id and a float32 log-probability each."""
        return (self.target_topk or 0) * 8

    @staticmethod
    def file_bytes(num_tokens: int, num_samples: int, token_bytes: int) -> int:
        """Bytes of a batch file's tensors for ``token_bytes`` per token (the header adds a few KB)."""
        return num_tokens * token_bytes + (num_samples + 1) * 8 + num_samples * 8

    def file_metadata(self) -> dict[str, str]:
        # target_topk only when stored: the files of runs without it are byte-for-byte as before it existed.
        return {
            "slot_layer_ids": json.dumps(list(self.slot_layers)),
            "final_state_slot": "" if self.final_slot is None else str(self.final_slot),
            "storage_dtype": self.storage_dtype or "",
            **({"target_topk": str(self.target_topk)} if self.target_topk else {}),
        }

    @classmethod
    def from_manifest(cls, manifest: dict) -> StateLayout:
        """The layout a manifest describes; version 1 outputs hold the captured layers only, unscaled."""
        ids = tuple(manifest["layer_ids"])
        return cls(
            ids,
            manifest.get("num_layers") or max(ids) + 1,
            bool(manifest.get("final_state")),
            manifest.get("storage_dtype"),
            manifest.get("target_topk"),
        )


def run_file_metadata(
    *,
    layout: StateLayout,
    presets: dict[str, list[int]],
    model: str,
    model_revision: str,
    model_config_hash: str,
    dtype: str,
    hidden_size: int,
    tokenizer_hash: str,
    chat_template_hash: str,
    plan_hash: str,
    kernels: str,
    compute: str = "bf16",
) -> dict[str, str]:
    """The run-wide part of every batch file's metadata."""
    layer_ids = layout.layer_ids
    return {
        "layer_ids": json.dumps(list(layer_ids)),
        "layer_convention": CONVENTION,
        "hf_output_hidden_states_index": json.dumps([k + 1 for k in layer_ids]),
        "pre_final_norm": "true",
        "presets": json.dumps(presets),
        **layout.file_metadata(),
        "model": model,
        "model_revision": model_revision,
        "model_config_hash": model_config_hash,
        "dtype": dtype,
        "hidden_size": str(hidden_size),
        "tokenizer_hash": tokenizer_hash,
        "chat_template_hash": chat_template_hash,
        "plan_hash": plan_hash,
        "kernels": kernels,
        "compute": compute,
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


def new_checksum() -> xxhash.xxh3_64:
    """A running checksum of the kind every hsextract checksum is (``update``, then ``hexdigest``: 16 hex)."""
    return xxhash.xxh3_64()


def update_checksum(checksum: xxhash.xxh3_64, data) -> None:
    """Feed ``data`` (any contiguous buffer) in ``CHECKSUM_CHUNK`` pieces, letting other threads run between."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), CHECKSUM_CHUNK):
        checksum.update(view[start : start + CHECKSUM_CHUNK])


def checksum_order(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """A batch file's tensor names as (per-token, index), each in name order: the order of the tensors in the file
    and the order in which a sample's checksum covers its rows of the per-token tensors."""
    names = sorted(names)
    return [n for n in names if n not in INDEX_TENSORS], [n for n in names if n in INDEX_TENSORS]


def checksums_metadata(
    *, per_token: list[str], samples: list[str], index_tensors: list[str], index: str
) -> dict[str, str]:
    """The ``checksums`` metadata entry: per sample, a checksum of its rows of the ``per_token`` tensors (in that
    order); one checksum of the ``index_tensors`` (whole, in that order)."""
    value = {
        "algorithm": CHECKSUM_ALGORITHM,
        "per_token_tensors": per_token,
        "samples": samples,
        "index_tensors": index_tensors,
        "index": index,
    }
    return {CHECKSUMS: json.dumps(value, separators=(",", ":"))}


def header_checksum(head: bytes) -> str:
    """The checksum of a batch file's header bytes (the 8-byte length and the JSON), as the manifest records it."""
    checksum = new_checksum()
    checksum.update(head)
    return checksum.hexdigest()


def bytes_per_token(num_slots: int, hidden: int, itemsize: int, scale_bytes: int = 0) -> int:
    """States of every slot (and their scales), plus the token id (int32) and its loss-mask byte."""
    return num_slots * (hidden * itemsize + scale_bytes) + 4 + 1
