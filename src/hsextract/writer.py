"""Batch files: safetensors written straight from the host buffer, under a temporary name, then renamed.

A batch file holds, for the B samples of one batch and their N valid tokens in total (docs/FORMAT.md):

- ``hidden_states`` [N, L, H]: the L captured layers, token-major, so one sample's states are one contiguous
  byte range (a reader fetches a sample with one ranged read).
- ``input_ids`` [N] int32, ``loss_mask`` [N] uint8, ``cu_seqlens`` [B+1] int64 (sample i is rows
  cu_seqlens[i]:cu_seqlens[i+1]), ``sample_index`` [B] int64 (row in the tokenized dataset).
- metadata (strings): layer ids and their convention, pre/post norm, model, dtype, tokenizer and chat-template
  hashes, plan hash, batch id, shard, sample ids (JSON), hsextract version.

The serializer is ours rather than ``safetensors.torch.save_file`` because that one first copies every tensor into
a bytes object; here the pinned host buffer is written to the file as it is. The files are standard safetensors
(the tests read them back with the safetensors library). Nothing time-dependent goes in, so a batch recomputed
after a crash is byte-identical to the first attempt.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from .rundir import atomic_write

MAX_HEADER_BYTES = 100_000_000
"""safetensors' own cap on a header; a larger declared length is damage, not data."""

SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write ``tensors`` (CPU, contiguous) to ``path`` atomically; returns the file size.

    Renamed into place only after flush and fsync: a file under its final name is complete.
    """
    path = Path(path)
    header = safetensors_header(tensors, metadata)

    def write(f) -> None:
        f.write(header)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))

    atomic_write(path, write)
    return path.stat().st_size


def read_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a local safetensors file, read from its header alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"declares a {n}-byte header")
        return json.loads(f.read(n)).get("__metadata__", {})
