"""What trainers call: ``open_output(path)`` over a local directory or ``s3://bucket/prefix``.

    from hsextract.reader import open_output
    out = open_output("s3://bucket/run1")
    len(out); out.layer_ids
    for s in out: ...            # batch by batch, in plan order
    s = out["conv-00042"]       # by sample id
    s["hidden_states"]           # [T, len(layer_ids) * hidden], the layers concatenated in id order (DFlash)
    s["layers"][16]              # [T, hidden], the output of decoder layer 16
    s["input_ids"], s["loss_mask"]

A complete output has ``manifest.json`` (written last by the launcher), which maps sample ids to batch files.
Reading a sample costs one ranged read of its states (they are contiguous in the file, token-major) plus two small
ones, never a whole batch file; each file's header is read once and cached.
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .output import read_manifest
from .storage import open_sink
from .writer import SAFETENSORS_DTYPES

_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class BatchFile:
    """One batch file read through ranged reads; only its header is held in memory."""

    def __init__(self, sink, key: str):
        self.sink, self.key = sink, key
        head = sink.read_range(key, 0, 8)
        (n,) = struct.unpack("<Q", head)
        header = json.loads(sink.read_range(key, 8, n))
        self.metadata: dict[str, str] = header.pop("__metadata__", {})
        base = 8 + n
        self.tensors = {
            name: TensorInfo(_DTYPES[h["dtype"]], tuple(h["shape"]), base + h["data_offsets"][0])
            for name, h in header.items()
        }
        self.sample_ids: list[str] = json.loads(self.metadata["sample_ids"])
        self.cu_seqlens = self.read_all("cu_seqlens").tolist()

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self.tensors[name]
        raw = self.sink.read_range(
            self.key, info.start + start * info.row_bytes, (stop - start) * info.row_bytes
        )
        return torch.frombuffer(bytearray(raw), dtype=info.dtype).view(stop - start, *info.shape[1:])

    def read_all(self, name: str) -> torch.Tensor:
        return self.read_rows(name, 0, self.tensors[name].shape[0])

    def sample(self, row: int, layer_ids: tuple[int, ...]) -> dict:
        a, b = self.cu_seqlens[row], self.cu_seqlens[row + 1]
        states = self.read_rows("hidden_states", a, b)  # [T, L, H]
        return {
            "sample_id": self.sample_ids[row],
            "input_ids": self.read_rows("input_ids", a, b).long(),
            "loss_mask": self.read_rows("loss_mask", a, b).bool(),
            "layers": {k: states[:, j] for j, k in enumerate(layer_ids)},
            "hidden_states": states.reshape(b - a, -1),
        }


class Output:
    """A finished hsextract output. Indexing by sample id and iteration read lazily."""

    def __init__(
        self, path: str, endpoint_url: str | None = None, cache_files: int = 8, retry_deadline_s: float = 120
    ):
        # A trainer should hear about an unreachable bucket within minutes, not after the uploader's 30-minute patience.
        self.sink = open_sink(path, endpoint_url, retry_deadline_s=retry_deadline_s)
        self.manifest = read_manifest(self.sink)
        self.layer_ids: tuple[int, ...] = tuple(self.manifest["layer_ids"])
        self.metadata: dict = self.manifest
        self._where: dict[str, tuple[str, int]] = {}
        self._order: list[str] = []
        for batch in self.manifest["batches"]:
            for row, sid in enumerate(batch["sample_ids"]):
                self._where[sid] = (batch["key"], row)
                self._order.append(sid)
        self._files: OrderedDict[str, BatchFile] = OrderedDict()
        self._cache_files = cache_files

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, sample_id) -> bool:
        return str(sample_id) in self._where

    def sample_ids(self) -> list[str]:
        return list(self._order)

    def _file(self, key: str) -> BatchFile:
        f = self._files.pop(key, None) or BatchFile(self.sink, key)
        self._files[key] = f
        while len(self._files) > self._cache_files:
            self._files.popitem(last=False)
        return f

    def __getitem__(self, sample_id) -> dict:
        try:
            key, row = self._where[str(sample_id)]
        except KeyError:
            raise KeyError(f"sample {sample_id!r} is not in this output") from None
        return self._file(key).sample(row, self.layer_ids)

    def __iter__(self):
        for batch in self.manifest["batches"]:
            f = self._file(batch["key"])
            for row in range(len(batch["sample_ids"])):
                yield f.sample(row, self.layer_ids)


def open_output(path: str, endpoint_url: str | None = None, *, retry_deadline_s: float = 120) -> Output:
    """Open a finished output (a local directory or ``s3://bucket/prefix``) for reading. Transient S3 errors are
    retried for ``retry_deadline_s`` seconds before a read fails."""
    return Output(str(path), endpoint_url, retry_deadline_s=retry_deadline_s)
