"""Batch files: safetensors written straight from the host buffer, under a temporary name, then renamed.

The checksums are computed from the host tensors about to be written: the last moment the bytes are known good.
The serializer is ours because ``safetensors.torch.save_file`` first copies every tensor into a bytes object; the
files are standard safetensors and hold nothing time-dependent, so a recomputed batch is byte-identical.
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import torch

from hsextract.container import header_bytes, header_json, kind_of, layout, read_file_head
from hsextract.errors import HsextractError
from hsextract.output.batch import checksum_order, checksums_metadata, new_checksum, update_checksum
from hsextract.output.header import tensor_bytes
from hsextract.storage.fileio import atomic_write


def batch_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The ``checksums`` metadata of a batch: per sample (rows ``cu_seqlens[i]:cu_seqlens[i+1]``), one checksum
    of its rows of every per-token tensor in name order; one of the index tensors. Generic: a per-token tensor
    added to the batch later (scales, a final-state slot) is covered without a change here."""
    per_token, index = checksum_order(tensors)
    bounds = tensors["cu_seqlens"].tolist()
    num_tokens = bounds[-1]
    rows = {}
    for name in per_token:
        t = tensors[name]
        if t.dim() == 0 or t.shape[0] != num_tokens:
            raise ValueError(
                f"per-token tensor {name!r} has shape {tuple(t.shape)}, expected {num_tokens} rows (cu_seqlens)"
            )
        rows[name] = (tensor_bytes(t), t.numel() // num_tokens * t.element_size() if num_tokens else 0)
    samples = []
    for start, stop in pairwise(bounds):
        checksum = new_checksum()
        for data, row_bytes in rows.values():
            update_checksum(checksum, data[start * row_bytes : stop * row_bytes])
        samples.append(checksum.hexdigest())
    checksum = new_checksum()
    for name in index:
        update_checksum(checksum, tensor_bytes(tensors[name]))
    return checksums_metadata(
        per_token=per_token, samples=samples, index_tensors=index, index=checksum.hexdigest()
    )


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> tuple[int, int]:
    """Write ``tensors`` (CPU, contiguous) to ``path`` atomically; returns the file's size and CRC32.

    The CRC32 is computed from the same buffers by a second thread while they are written (zlib releases the GIL),
    so the write takes about as long as the slower of the two instead of both. Renamed into place only after flush
    and fsync: a file under its final name is complete.
    """
    path = Path(path)
    entries = layout((name, kind_of(t.dtype), t.shape) for name, t in tensors.items())
    parts = [memoryview(header_bytes(entries, metadata))]
    parts += [tensor_bytes(t) for t in tensors.values() if t.numel()]

    def write(f) -> tuple[int, int]:
        with ThreadPoolExecutor(1, thread_name_prefix="crc32") as pool:
            crc = pool.submit(crc32_of, parts)
            for part in parts:
                f.write(part)
            return sum(len(part) for part in parts), crc.result()

    return atomic_write(path, write)


def crc32_of(parts) -> int:
    """The CRC32 of the buffers one after the other."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def write_batch_file(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> tuple[int, int]:
    """Write a batch file: per-token tensors then index tensors, each group in name order, and ``metadata``
    plus the checksums of the tensors. Returns the file's size and CRC32."""
    per_token, index = checksum_order(tensors)
    ordered = {name: tensors[name] for name in per_token + index}
    return write_safetensors(path, ordered, {**metadata, **batch_checksums(ordered)})


def read_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a local batch file, read from its header alone (``HsextractError`` if damaged)."""
    header = header_json(read_file_head(path), lambda why: HsextractError(f"{path} {why}"))
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise HsextractError(f"{path} has a garbled header (its metadata is not an object)")
    return metadata
