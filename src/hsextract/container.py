"""The safetensors container, written and read: the one codec of the batch files, the sample index, the token file
and the checkpoint reader (startup/fastload.py). A file is an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range in the data section; ``__metadata__``: strings), then the tensors back to back.

numpy only, and only where arrays are made: the uploader parses headers without loading numpy or torch.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from hsextract.errors import HsextractError

HEADER_LENGTH_BYTES = 8


MAX_HEADER_BYTES = 100_000_000

"""The largest header a file may declare (the safetensors library's own limit)."""


DTYPES = {
    kind: (name, int(size))
    for kind, name, size in map(
        str.split,
        """BF16 bfloat16 2 | F16 float16 2 | F32 float32 4 | F64 float64 8 | I64 int64 8 | I32 int32 4 | I16 int16 2
        | I8 int8 1 | U8 uint8 1 | BOOL bool 1 | F8_E4M3 float8_e4m3fn 1 | F8_E5M2 float8_e5m2 1""".split(
            "|"
        ),
    )
}

"""Each safetensors dtype -> its name in torch (numpy's too, where numpy holds it) and its bytes per item."""


NOT_IN_NUMPY = ("BF16", "F8_E4M3", "F8_E5M2")


def kind_of(dtype) -> str:
    """The safetensors name of a torch or numpy dtype, e.g. ``BF16`` for ``torch.bfloat16``, ``I64`` for int64."""
    name = str(dtype).removeprefix("torch.")
    return next(kind for kind, (dtype_name, _) in DTYPES.items() if dtype_name == name)


def torch_dtype(kind: str):
    """The torch dtype of a safetensors one (imports torch)."""
    import torch

    return getattr(torch, DTYPES[kind][0])


def numpy_dtype(kind: str):
    """The numpy dtype of a safetensors one; ``KeyError`` for one numpy does not hold (``NOT_IN_NUMPY``)."""
    import numpy as np

    if kind in NOT_IN_NUMPY:
        raise KeyError(f"numpy holds no {kind}")
    return np.dtype(DTYPES[kind][0])


def layout(tensors: Iterable[tuple[str, str, Sequence[int]]]) -> dict[str, dict]:
    """Each tensor's header entry, from its name, safetensors dtype and shape: its bytes right after the previous
    one's (safetensors allows no gap)."""
    entries, offset = {}, 0
    for name, kind, shape in tensors:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * DTYPES[kind][1]
        entries[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return entries


def header_bytes(entries: dict[str, dict], metadata: dict[str, str], *, reserve: int = 0) -> bytes:
    """The length prefix and the JSON header, padded with spaces so that the data starts 8-byte aligned, or to
    ``reserve`` bytes where it fits in them (a file whose room for the header was kept before its data)."""
    raw = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    raw += b" " * ((reserve - len(raw)) if len(raw) <= reserve else (-len(raw) % 8))
    return struct.pack("<Q", len(raw)) + raw


def read_head(read, damaged, header_size: int | None = None) -> bytes:
    """A file's header bytes (length prefix + JSON), through ``read(offset, length)``, which raises on a short read.
    ``damaged(why)`` makes the exception for a file that is not one; ``header_size`` (the manifest's) saves a read."""
    if (
        header_size is not None
        and HEADER_LENGTH_BYTES <= header_size <= HEADER_LENGTH_BYTES + MAX_HEADER_BYTES
    ):
        head = read(0, header_size)
    else:
        head = read(0, HEADER_LENGTH_BYTES)
    (n,) = struct.unpack("<Q", head[:HEADER_LENGTH_BYTES])
    if n > MAX_HEADER_BYTES:
        raise damaged(
            f"declares a header of {n} bytes, over the {MAX_HEADER_BYTES}-byte cap: the file is garbled"
        )
    if header_size is not None and header_size != HEADER_LENGTH_BYTES + n:
        raise damaged(
            f"declares a header of {n} bytes; the manifest recorded {header_size - HEADER_LENGTH_BYTES}"
        )
    if len(head) < HEADER_LENGTH_BYTES + n:
        head += read(HEADER_LENGTH_BYTES, n)
    return head[: HEADER_LENGTH_BYTES + n]


def header_json(head: bytes, damaged) -> dict:
    """The JSON object of a header read by ``read_head`` (``__metadata__`` included)."""
    try:
        header = json.loads(head[HEADER_LENGTH_BYTES:])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise damaged(f"has a garbled header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise damaged("has a garbled header (not a JSON object)")
    return header


def read_file_head(path: str | Path, damaged=None) -> bytes:
    """The header bytes of a local file; ``damaged(why)`` (default: ``HsextractError`` naming the path) if it has
    none."""
    damaged = damaged or (lambda why: HsextractError(f"{path} {why}"))
    with open(path, "rb") as f:

        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            raw = f.read(length)
            if len(raw) < length:
                raise damaged(f"ends inside its header ({offset + len(raw)} of {offset + length} bytes)")
            return raw

        return read_head(read, damaged)


def buffer_head(buffer, damaged) -> bytes:
    """The header bytes of a file held whole in ``buffer`` (bytes, a memory map)."""
    view = memoryview(buffer)

    def read(offset: int, length: int) -> bytes:
        if offset + length > len(view):
            raise damaged(f"is truncated ({len(view)} bytes, its header needs {offset + length})")
        return bytes(view[offset : offset + length])

    return read_head(read, damaged)


def arrays(buffer, header: dict, data_start: int, damaged) -> dict:
    """Each tensor of ``header`` (its ``__metadata__`` left out) as a flat numpy view into ``buffer`` (a file held
    whole: bytes, a memory map), checked to lie inside it; ``damaged(why)`` if one does not."""
    import numpy as np

    view = memoryview(buffer)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
            dtype = numpy_dtype(info["dtype"])
            count = 1
            for d in info["shape"]:
                count *= int(d)
        except (TypeError, KeyError, ValueError):
            raise damaged(f"has a garbled header (tensor {name})") from None
        if not 0 <= start <= stop <= len(view) - data_start or stop - start != count * dtype.itemsize:
            raise damaged(f"has tensor {name} outside the file (bytes {start}..{stop} of its data)")
        out[name] = np.frombuffer(view, dtype=dtype, count=count, offset=data_start + start)
    return out


def map_file(path: str | Path):
    """The file at ``path`` as read-only bytes (a numpy uint8 array) in shared, file-backed memory."""
    import numpy as np

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return np.zeros(0, np.uint8)
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
