"""What trainers call: ``open_output(path)`` over a local directory or ``s3://bucket/prefix``.

    from hsextract.reader import open_output
    out = open_output("s3://bucket/run1")
    len(out); out.layer_ids
    for s in out: ...            # batch by batch, in plan order
    s = out["conv-00042"]       # by sample id
    s["hidden_states"]           # [T, len(layer_ids) * hidden], the layers concatenated in id order (DFlash)
    s["layers"][16]              # [T, hidden], the output of decoder layer 16
    s["input_ids"], s["loss_mask"]
    s["final_hidden_state"]      # [T, hidden], after the final norm = HF output_hidden_states[-1] (--final-state)
    s["final_hidden_state_prenorm"]  # [T, hidden], the last decoder layer's raw output

A complete output has ``manifest.json`` (written last by the launcher), which maps sample ids to batch files.
Reading a sample costs one ranged read of its states (they are contiguous in the file, token-major) plus two small
ones, never a whole batch file; each file's header and index tensors are read once (two reads) and cached.

Verification is on by default and costs no extra read: when a file is opened its header must match the checksum
the manifest recorded, its index tensors their checksum, and its sample ids the manifest's; when a sample is read,
its rows must match the sample's checksum (format/batch.py defines the checksums). ``open_output(..., verify=False)``
skips the checksums for speed (docs/PERFORMANCE.md has the cost); the structure is checked either way. Whatever is
wrong with a file (missing, empty, truncated, a garbled or oversized header, a missing tensor, a checksum
mismatch) raises ``CorruptOutputError`` naming the file and the problem; ``hsextract verify`` checks every file.

fp8 outputs (``--storage-dtype float8_e4m3fn``) are dequantized to bfloat16 (``dtype=``) by default;
``open_output(path, dequantize=False)`` gives the stored fp8 values instead, with ``s["scales"][k]`` [T] float32
per layer (value = fp8 * scale), ``s["hidden_states_scale"]`` [T, layers] and
``s["final_hidden_state_prenorm_scale"]`` [T]; ``final_hidden_state`` is still derived from the dequantized state.
The final state's slot is part of the sample's states (the same read); the normed final state is computed here from
the stored one with the model's own norm rule (format/final_norm.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from itertools import pairwise

import torch

from hsextract.errors import CorruptOutputError
from hsextract.format.batch import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS,
    INDEX_TENSORS,
    StateLayout,
    header_checksum,
    header_json,
    new_checksum,
    read_head,
    update_checksum,
)
from hsextract.format.final_norm import FinalNorm, read_final_norm
from hsextract.format.fp8 import dequantize_fp8
from hsextract.format.manifest import header_expectations, header_mismatch, read_manifest, require_checksums
from hsextract.run.writer import SAFETENSORS_DTYPES
from hsextract.storage import open_sink

_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in _DTYPES.items()}


REQUIRED_TENSORS = ("hidden_states", "input_ids", "loss_mask", "cu_seqlens")

"""Tensors every batch file has (docs/FORMAT.md); ``sample_index`` is optional for the reader."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    stop: int

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


def _read(sink, key: str, offset: int, length: int, damaged) -> bytes:
    """Exactly ``length`` bytes at ``offset``, or ``damaged`` saying where the file ends."""
    try:
        raw = sink.read_range(key, offset, length) if length else b""
    except FileNotFoundError:
        raise damaged("does not exist (listed in the manifest)") from None
    except IsADirectoryError:
        raise damaged("is a directory, not a batch file") from None
    if len(raw) != length:
        end = offset + len(raw)
        raise damaged(
            "is empty"
            if end == 0
            else f"is truncated: it ends at byte {end}, bytes up to {offset + length} expected"
        )
    return raw


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
            dtype_name in _DTYPES
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
    if not 0 <= start <= stop or stop - start != numel * _ITEMSIZE[dtype_name]:
        raise damaged(
            f"has a garbled header (tensor {name}: {list(shape)} {dtype_name} in bytes {start}..{stop})"
        )
    return TensorInfo(_DTYPES[dtype_name], tuple(shape), header_size + start, header_size + stop)


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


def _tensor(raw: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    # A bytearray (what a local read returns) is this tensor's own memory; bytes are copied into one.
    return torch.frombuffer(raw if isinstance(raw, bytearray) else bytearray(raw), dtype=dtype).view(shape)


class BatchFile:
    """One batch file read through ranged reads; only its header and index tensors are held in memory.

    ``entry`` is the file's batch entry in the manifest (its sample ids, size and header checksum); with ``verify``
    the header, the index tensors and every sample read are checked against their checksums. ``expect`` holds
    header fields that must match (``manifest.header_expectations``: plan hash, layer ids, batch id, shard)."""

    def __init__(
        self, sink, key: str, entry: dict | None = None, *, verify: bool = True, expect: dict | None = None
    ):
        self.sink, self.key, self.verify = sink, key, verify
        entry = entry or {}
        head = read_head(
            lambda o, n: _read(sink, key, o, n, self.damaged), self.damaged, entry.get("header_size")
        )
        if verify and "header_xxh3" in entry and header_checksum(head) != entry["header_xxh3"]:
            raise self.damaged(
                f"its header ({len(head)} bytes) differs from the one the manifest recorded (checksum "
                f"{header_checksum(head)}, recorded {entry['header_xxh3']})"
            )
        self.header = BatchHeader(head, self.damaged)
        h = self.header
        if verify:
            if h.checksums is None:
                raise self.damaged(
                    "has no checksums (written by an hsextract before batch format 2); "
                    "open_output(..., verify=False) reads it unchecked"
                )
            if "size" in entry and h.data_end != entry["size"]:
                raise self.damaged(
                    f"its header describes {h.data_end} bytes; the manifest recorded {entry['size']}"
                )
        if "sample_ids" in entry and entry["sample_ids"] != h.sample_ids:
            raise self.damaged("holds other samples than the manifest lists for it")
        if expect and (mismatch := header_mismatch(h.metadata, expect)):
            raise self.damaged(f"{mismatch}: the manifest was edited or describes another output")
        self.metadata, self.tensors, self.sample_ids = h.metadata, h.tensors, h.sample_ids
        self.cu_seqlens = self._read_index()

    def damaged(self, problem: str) -> CorruptOutputError:
        return CorruptOutputError(self.sink.url, self.key, problem)

    def _read_index(self) -> list[int]:
        """The index tensors in one read (they are adjacent, after the per-token ones), checked; cu_seqlens."""
        h = self.header
        names = (
            list(h.checksums.index_tensors) if h.checksums else [n for n in INDEX_TENSORS if n in h.tensors]
        )
        names = names or ["cu_seqlens"]
        start = min(h.tensors[n].start for n in names)
        stop = max(h.tensors[n].stop for n in names)
        raw = _read(self.sink, self.key, start, stop - start, self.damaged)
        if self.verify:
            checksum = new_checksum()
            for name in names:
                update_checksum(checksum, raw[h.tensors[name].start - start : h.tensors[name].stop - start])
            if checksum.hexdigest() != h.checksums.index:
                raise self.damaged(f"its index tensors ({', '.join(names)}) do not match their checksum")
        info = h.tensors["cu_seqlens"]
        cu = _tensor(raw[info.start - start : info.stop - start], info.dtype, info.shape).tolist()
        if (
            info.dtype != torch.int64
            or len(info.shape) != 1
            or len(cu) != len(h.sample_ids) + 1
            or cu[0] != 0
            or cu[-1] != h.num_tokens
            or any(a > b for a, b in pairwise(cu))
        ):
            raise self.damaged(
                f"has inconsistent cu_seqlens (starts {cu[:3]}, ends {cu[-2:]}) for {len(h.sample_ids)} samples "
                f"and {h.num_tokens} tokens"
            )
        return cu

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self.tensors[name]
        return _tensor(self._rows(name, start, stop), info.dtype, (stop - start, *info.shape[1:]))

    def _rows(self, name: str, start: int, stop: int) -> bytes:
        info = self.tensors[name]
        offset = info.start + start * info.row_bytes
        return _read(self.sink, self.key, offset, (stop - start) * info.row_bytes, self.damaged)

    def read_all(self, name: str) -> torch.Tensor:
        return self.read_rows(name, 0, self.tensors[name].shape[0])

    def sample(self, row: int, view: SampleView) -> dict:
        a, b = self.cu_seqlens[row], self.cu_seqlens[row + 1]
        raw = {name: self._rows(name, a, b) for name in self.header.per_token}
        if self.verify:
            checksum = new_checksum()
            for name in self.header.per_token:
                update_checksum(checksum, raw[name])
            if checksum.hexdigest() != self.header.checksums.samples[row]:
                raise self.damaged(
                    f"sample {self.sample_ids[row]!r} (row {row}, tokens {a}..{b}) does not match its checksum: "
                    "its bytes were altered"
                )
        tensors = {
            name: _tensor(raw[name], self.tensors[name].dtype, (b - a, *self.tensors[name].shape[1:]))
            for name in self.header.per_token
        }
        states = tensors.pop("hidden_states")  # [T, slots, H]
        slots = view.layout.slot_layers
        if states.dim() != 3 or states.shape[1] != len(slots):
            raise self.damaged(f"holds states of shape {list(states.shape)} for the layers {list(slots)}")
        scale = tensors.pop("hidden_states_scale", None)  # [T, slots] with fp8 storage
        if view.layout.scaled and (scale is None or tuple(scale.shape) != tuple(states.shape[:2])):
            raise self.damaged("stores fp8 states without a scale for each token of each layer")
        return {
            **tensors,
            "sample_id": self.sample_ids[row],
            "input_ids": tensors["input_ids"].long(),
            "loss_mask": tensors["loss_mask"].bool(),
            **view.states(states, scale),
        }


@dataclass(frozen=True)
class SampleView:
    """How a sample's stored slots become the keys a trainer reads."""

    layout: StateLayout
    final_norm: FinalNorm | None
    dequantize: bool = True
    dtype: torch.dtype = torch.bfloat16

    def states(self, states: torch.Tensor, scale: torch.Tensor | None) -> dict:
        ids, n = self.layout.layer_ids, len(self.layout.layer_ids)
        tokens = states.shape[0]
        out: dict = {}
        if scale is not None and self.dequantize:
            states, scale = dequantize_fp8(states, scale, self.dtype), None
        out["layers"] = {k: states[:, j] for j, k in enumerate(ids)}
        out["hidden_states"] = states[:, :n].reshape(tokens, -1)
        if scale is not None:
            out["scales"] = {k: scale[:, j] for j, k in enumerate(ids)}
            out["hidden_states_scale"] = scale[:, :n]
        f = self.layout.final_slot
        if f is not None:
            prenorm = states[:, f]
            out["final_hidden_state_prenorm"] = prenorm
            if scale is not None:
                out["final_hidden_state_prenorm_scale"] = scale[:, f]
                prenorm = dequantize_fp8(prenorm, scale[:, f], self.dtype)
            out["final_hidden_state"] = self.final_norm(prenorm)
        return out


class Output:
    """A finished hsextract output. Indexing by sample id and iteration read lazily."""

    def __init__(
        self,
        path: str,
        endpoint_url: str | None = None,
        cache_files: int = 8,
        retry_deadline_s: float = 120,
        verify: bool = True,
        *,
        dequantize: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        manifest: dict | None = None,
        cache_dir: str | None = None,
        cache_max_gb: float = 100.0,
    ):
        # A trainer should hear about an unreachable bucket within minutes, not after the uploader's 30-minute patience.
        self.sink = open_sink(path, endpoint_url, retry_deadline_s=retry_deadline_s)
        # ``manifest``: one read already (a training process's index), or the live view of an output still being
        # written (training/follow.py), whose batch entries are filled in as their completion records appear.
        self.manifest = read_manifest(self.sink) if manifest is None else manifest
        self.verify = verify
        if verify:
            require_checksums(
                self.sink, self.manifest, "it cannot be verified; open_output(..., verify=False) reads it"
            )
        if cache_dir is not None:  # batch files and final norm in blocks on local disk (storage/cache.py)
            from hsextract.storage.cache import CachedSink, manifest_versions

            versions, limit = manifest_versions(self.manifest), int(cache_max_gb * 1e9)
            self.sink = CachedSink(self.sink, cache_dir, limit, versions, identity=f"{endpoint_url}|{path}")
        self.layer_ids: tuple[int, ...] = tuple(self.manifest["layer_ids"])
        self.metadata: dict = self.manifest
        self._entries = {batch["key"]: batch for batch in self.manifest["batches"]}
        self.layout = StateLayout.from_manifest(self.manifest)
        norm = None
        if self.layout.final_state:
            norm = read_final_norm(self.sink, self.manifest["final_state"]["norm"], verify=verify)
        self._view = SampleView(self.layout, norm, dequantize, dtype)
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

    def batch_file(self, key: str) -> BatchFile:
        """The batch file under ``key`` (header cached): ``read_all("input_ids")``, ``cu_seqlens``..."""
        return self._file(key)

    def batch_samples(self, key: str):
        """Every sample of one batch file, in row order."""
        f = self._file(key)
        for row in range(len(f.sample_ids)):
            yield f.sample(row, self._view)

    def _file(self, key: str) -> BatchFile:
        f = self._files.pop(key, None) or BatchFile(
            self.sink,
            key,
            self._entries[key],
            verify=self.verify,
            expect=header_expectations(self.manifest, self._entries[key]),
        )
        self._files[key] = f
        while len(self._files) > self._cache_files:
            self._files.popitem(last=False)
        return f

    def open_batch_file(self, key: str) -> BatchFile:
        """A new ``BatchFile`` for ``key``, outside the cache (the training loader keeps its own, one per thread)."""
        return BatchFile(self.sink, key, self._entries[key], verify=self.verify)

    def read_sample(self, f: BatchFile, row: int) -> dict:
        """Sample ``row`` of the open batch file ``f`` as this output's reader dict (checked, fp8 dequantized)."""
        return f.sample(row, self._view)

    def __getitem__(self, sample_id) -> dict:
        try:
            key, row = self._where[str(sample_id)]
        except KeyError:
            raise KeyError(f"sample {sample_id!r} is not in this output") from None
        return self._file(key).sample(row, self._view)

    def __iter__(self):
        for batch in self.manifest["batches"]:
            yield from self.batch_samples(batch["key"])


def open_output(
    path: str,
    endpoint_url: str | None = None,
    *,
    retry_deadline_s: float = 120,
    verify: bool = True,
    dequantize: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    **options,
) -> Output:
    """Open a finished output (a local directory or ``s3://bucket/prefix``) for reading. Transient S3 errors are
    retried for ``retry_deadline_s`` seconds before a read fails. With ``verify`` (the default) every header and
    sample read is checked against its checksum; a damaged file raises ``CorruptOutputError``. fp8 states are
    dequantized to ``dtype`` unless ``dequantize=False``. ``options``: ``cache_dir=`` keeps what is read in a local
    disk cache of at most ``cache_max_gb=`` (100) (storage/cache.py), for reading an S3 output many times;
    ``manifest=`` the manifest read already."""
    return Output(
        str(path),
        endpoint_url,
        retry_deadline_s=retry_deadline_s,
        verify=verify,
        dequantize=dequantize,
        dtype=dtype,
        **options,
    )
