"""A batch file's header, parsed and checked: its tensors (dtype, shape, byte range), sample ids and checksums.

The one reading of what a header says, for the reader, ``hsextract verify`` and the training loader; the bytes of
the header itself (its length prefix and JSON) are container.py's, its checksums output/batch.py's. Whatever is wrong raises the caller's
``damaged(problem)``, so every error names the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from hsextract.container import DTYPES, header_json, torch_dtype
from hsextract.output.batch import CHECKSUM_ALGORITHM, CHECKSUMS, INDEX_TENSORS

BATCH_DTYPES = ("BF16", "F16", "F32", "I32", "I64", "U8", "F8_E4M3")

"""The safetensors dtypes a batch file may hold (container.py's table says what each is). No torch import here:
finalize and verify open batch files in processes that never load torch."""


REQUIRED_TENSORS = ("hidden_states", "input_ids", "loss_mask", "cu_seqlens")

"""Tensors every batch file has (docs/FORMAT.md); ``sample_index`` is optional for the reader."""


@dataclass(frozen=True)
class TensorInfo:
    kind: str
    """Its safetensors dtype (``BF16``, ``I64``...)."""
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    stop: int

    @property
    def dtype(self):
        """Its torch dtype (imports torch)."""
        return torch_dtype(self.kind)

    @property
    def row_bytes(self) -> int:
        return (self.stop - self.start) // self.shape[0] if self.shape and self.shape[0] else 0


@dataclass(frozen=True)
class Checksums:
    """A batch file's checksums (output.checksums_metadata)."""

    per_token: tuple[str, ...]
    samples: tuple[str, ...]
    index_tensors: tuple[str, ...]
    index: str


class BatchHeader:
    """A batch file's header, parsed and checked: every tensor has a known dtype, a shape whose size matches its
    byte range, and lies after the header; the required tensors, the sample ids and (format 2) the checksums are
    there. Anything else raises ``damaged``."""

    def __init__(self, head: bytes, damaged):
        header = header_json(head, damaged)
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict):
            raise damaged("has a garbled header (its metadata is not an object)")
        self.size = len(head)
        self.metadata: dict[str, str] = metadata
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = _tensor_info(name, entry, self.size, damaged)
        missing = [name for name in REQUIRED_TENSORS if name not in self.tensors]
        if missing:
            raise damaged(f"lacks the tensor(s) {', '.join(missing)}")
        self.data_end = max(t.stop for t in self.tensors.values())
        self.num_tokens = (self.tensors["hidden_states"].shape or (-1,))[0]
        self.per_token = sorted(name for name in self.tensors if name not in INDEX_TENSORS)
        for name in self.per_token:
            shape = self.tensors[name].shape
            if not shape or shape[0] != self.num_tokens:
                raise damaged(f"tensor {name} has shape {list(shape)}, expected {self.num_tokens} rows")
        self.sample_ids = _json_list(metadata, "sample_ids", damaged)
        if not all(isinstance(sid, str) for sid in self.sample_ids):
            raise damaged("has a garbled header (sample_ids is not a list of strings)")
        self.checksums: Checksums | None = None
        if CHECKSUMS in metadata:
            self.checksums = _checksums(metadata, self, damaged)


def _tensor_info(name: str, entry, header_size: int, damaged) -> TensorInfo:
    try:
        dtype_name, shape, (start, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = (
            dtype_name in BATCH_DTYPES
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(start, int)
            and isinstance(stop, int)
        )
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise damaged(f"has a garbled header (the entry of tensor {name} is {json.dumps(entry)[:200]})")
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= start <= stop or stop - start != numel * DTYPES[dtype_name][1]:
        raise damaged(
            f"has a garbled header (tensor {name}: {list(shape)} {dtype_name} in bytes {start}..{stop})"
        )
    return TensorInfo(dtype_name, tuple(shape), header_size + start, header_size + stop)


def _json_list(metadata: dict, field: str, damaged) -> list:
    try:
        value = json.loads(metadata[field])
    except KeyError:
        raise damaged(f"has no {field} in its metadata") from None
    except (TypeError, json.JSONDecodeError):
        value = None
    if not isinstance(value, list):
        raise damaged(f"has a garbled header ({field} is not a JSON list)")
    return value


def _checksums(metadata: dict, header: BatchHeader, damaged) -> Checksums:
    try:
        c = json.loads(metadata[CHECKSUMS])
        checksums = Checksums(
            tuple(c["per_token_tensors"]), tuple(c["samples"]), tuple(c["index_tensors"]), c["index"]
        )
        algorithm = c["algorithm"]
    except (TypeError, KeyError, json.JSONDecodeError):
        raise damaged("has a garbled header (its checksums entry is unreadable)") from None
    if algorithm != CHECKSUM_ALGORITHM:
        raise damaged(f"uses checksum algorithm {algorithm!r}, this hsextract knows {CHECKSUM_ALGORITHM!r}")
    if list(checksums.per_token) != header.per_token or len(checksums.samples) != len(header.sample_ids):
        raise damaged(
            f"has checksums of {len(checksums.samples)} samples over {list(checksums.per_token)}, but holds "
            f"{len(header.sample_ids)} samples in {header.per_token}"
        )
    missing = [name for name in checksums.index_tensors if name not in header.tensors]
    if missing:
        raise damaged(f"lacks the tensor(s) {', '.join(missing)}")
    return checksums


def tensor_bytes(t) -> memoryview:
    """The bytes of a contiguous CPU tensor (torch or numpy), without a copy."""
    if isinstance(t, np.ndarray):
        return memoryview(t.reshape(-1).view(np.uint8))
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
