"""One batch file of an output, read through ranged reads and checked: what the reader, the training loader,
export and ``hsextract verify`` read a batch file with.

``BatchFile`` holds the header and the small per-token tensors and serves samples, each checked against its own
checksum as its bytes arrive; ``SampleView`` turns stored slots into the keys a trainer reads. Anything wrong raises
``CorruptOutputError`` naming the file. Opening a file needs no torch (finalize and verify never import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from hsextract.container import NOT_IN_NUMPY, numpy_dtype, read_head
from hsextract.errors import CorruptOutputError
from hsextract.output.batch import (
    INDEX_TENSORS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    StateLayout,
    header_checksum,
    new_checksum,
    update_checksum,
)
from hsextract.output.final_norm import FinalNorm
from hsextract.output.header import BatchHeader, tensor_bytes
from hsextract.output.manifest import header_expectations, header_mismatch

if TYPE_CHECKING:
    import torch

HELD_ROW_BYTES = 256

"""Per-token tensors of at most this many bytes a token besides the states (token ids and loss mask: 5 bytes; fp8
scales: 4 per slot) are read with the index tensors when a file is opened, in the same read (the writer puts them
next to each other, after the states), and held with the header: a run of samples then costs one read of states."""


def _short(offset: int, got: int, length: int, damaged) -> CorruptOutputError:
    end = offset + got
    return damaged(
        "is empty"
        if end == 0
        else f"is truncated: it ends at byte {end}, bytes up to {offset + length} expected"
    )


def _missing(read):
    """``read()``, with a missing file or a directory in its place said as damage."""

    def checked(sink, key, offset, what, damaged, *args):
        try:
            return read(sink, key, offset, what, *args)
        except FileNotFoundError:
            raise damaged("does not exist (listed in the manifest)") from None
        except IsADirectoryError:
            raise damaged("is a directory, not a batch file") from None

    return checked


@_missing
def _read_range(sink, key, offset, length):
    return sink.read_range(key, offset, length) if length else b""


@_missing
def _read_range_into(sink, key, offset, buffer, on_part):
    return sink.read_range_into(key, offset, buffer, on_part) if len(buffer) else 0


def _read(sink, key: str, offset: int, length: int, damaged) -> bytes:
    """Exactly ``length`` bytes at ``offset``, or ``damaged`` saying where the file ends."""
    raw = _read_range(sink, key, offset, length, damaged)
    if len(raw) != length:
        raise _short(offset, len(raw), length, damaged)
    return raw


def _read_into(sink, key: str, offset: int, buffer: torch.Tensor, damaged, on_part=None) -> None:
    """``buffer`` (uint8) filled from ``offset``, or ``damaged`` saying where the file ends."""
    got = _read_range_into(sink, key, offset, tensor_bytes(buffer), damaged, on_part)
    if got != buffer.numel():
        raise _short(offset, got, buffer.numel(), damaged)


def _tensor(raw: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    import torch

    if not raw:
        return torch.empty(shape, dtype=dtype)
    # A bytearray (what a local read returns) is this tensor's own memory; bytes are copied into one.
    return torch.frombuffer(raw if isinstance(raw, bytearray) else bytearray(raw), dtype=dtype).view(shape)


def plain_memory(nbytes: int) -> torch.Tensor:
    """Where states are read to unless the caller says otherwise (``alloc``): ordinary process memory."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8)


def _empty(alloc, shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in memory from ``alloc``."""
    numel = 1
    for d in shape:
        numel *= d
    return alloc(numel * dtype.itemsize).view(dtype).view(shape)


def _adjacent(spans: list[tuple[int, int, str]]) -> list[tuple[int, int, list[str]]]:
    """Byte ranges (start, stop, name) merged where one ends where the next starts: one read each."""
    merged: list[tuple[int, int, list[str]]] = []
    for start, stop, name in sorted(spans):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop, [*merged[-1][2], name])
        else:
            merged.append((start, stop, [name]))
    return merged


class _Arriving:
    """The checksums of several samples fed with their states as a read brings them in, part by part, while the
    bytes are still in the CPU's cache (hashing them after the read would fetch them from memory again).
    ``spans``: (row, start, stop) of each sample in ``view``. A read that starts again starts them again; ``finish``
    hashes what the sink did not tell."""

    def __init__(self, view: memoryview, spans: list[tuple[int, int, int]]):
        self.view, self.spans = view, spans
        self.sums, self.done = {}, 0
        self._restart()

    def _restart(self) -> None:
        self.sums = {row: new_checksum() for row, _, _ in self.spans}
        self.done = 0

    def __call__(self, start: int, stop: int) -> None:
        if start != self.done:
            self._restart()
            if start:  # not where a read starts: left to finish
                return
        for row, a, b in self.spans:
            if max(a, start) < min(b, stop):
                update_checksum(self.sums[row], self.view[max(a, start) : min(b, stop)])
        self.done = stop

    def finish(self) -> None:
        self(self.done, len(self.view))


class BatchFile:
    """One batch file read through ranged reads; only its header, index tensors and the small per-token tensors
    (token ids, loss mask, fp8 scales: ``HELD_ROW_BYTES``) are held in memory, never the states.

    ``entry`` is the file's batch entry in the manifest (its sample ids, size and header checksum); with ``verify``
    the header, the index tensors and every sample read are checked against their checksums. ``expect`` holds
    header fields that must match (``BatchFile.listed`` takes them from the manifest: plan hash, layer ids, batch id, shard)."""

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
        self._held_bytes: dict[str, bytes] = {}
        self.cu_seqlens = self._read_held()

    @classmethod
    def listed(cls, sink, manifest: dict, entry: dict, *, verify: bool = True) -> BatchFile:
        """The batch file of the manifest's ``entry``, its header held to what the manifest says of the output."""
        return cls(sink, entry["key"], entry, verify=verify, expect=header_expectations(manifest, entry))

    def damaged(self, problem: str) -> CorruptOutputError:
        return CorruptOutputError(self.sink.url, self.key, problem)

    def _read_held(self) -> list[int]:
        """The index tensors, checked, and the small per-token tensors (held whole), in one read where they are
        adjacent (the writer's layout); cu_seqlens."""
        h = self.header
        names = (
            list(h.checksums.index_tensors) if h.checksums else [n for n in INDEX_TENSORS if n in h.tensors]
        )
        names = names or ["cu_seqlens"]
        small = [n for n in h.per_token if n != "hidden_states" and h.tensors[n].row_bytes <= HELD_ROW_BYTES]
        raw: dict[str, bytes] = {}
        for start, stop, group in _adjacent(
            [(h.tensors[n].start, h.tensors[n].stop, n) for n in names + small]
        ):
            data = _read(self.sink, self.key, start, stop - start, self.damaged)
            for n in group:
                raw[n] = data[h.tensors[n].start - start : h.tensors[n].stop - start]
        if self.verify:
            checksum = new_checksum()
            for name in names:
                update_checksum(checksum, raw[name])
            if checksum.hexdigest() != h.checksums.index:
                raise self.damaged(f"its index tensors ({', '.join(names)}) do not match their checksum")
        info = h.tensors["cu_seqlens"]
        as_read = None if info.kind in NOT_IN_NUMPY else numpy_dtype(info.kind)
        cu = np.frombuffer(raw["cu_seqlens"], dtype=as_read).tolist() if as_read else []
        if (
            info.kind != "I64"
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
        self._held_bytes = {n: raw[n] for n in small}
        return cu

    @cached_property
    def _held(self) -> dict[str, torch.Tensor]:
        return {
            n: _tensor(raw, self.tensors[n].dtype, self.tensors[n].shape)
            for n, raw in self._held_bytes.items()
        }

    def read_array(self, name: str) -> np.ndarray:
        """Tensor ``name`` whole, as a numpy array (a dtype numpy holds: token ids, loss mask...), unchecked; no
        torch."""
        info = self.tensors[name]
        raw = self._held_bytes.get(name)
        if raw is None:
            raw = _read(self.sink, self.key, info.start, info.stop - info.start, self.damaged)
        return np.frombuffer(raw, dtype=numpy_dtype(info.kind)).reshape(info.shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name``, unchecked (a sample's rows are checked by ``samples``)."""
        if name in self._held_bytes:
            return self._held[name][start:stop].clone()
        info = self.tensors[name]
        raw = _read(
            self.sink,
            self.key,
            info.start + start * info.row_bytes,
            (stop - start) * info.row_bytes,
            self.damaged,
        )
        return _tensor(raw, info.dtype, (stop - start, *info.shape[1:]))

    def read_all(self, name: str) -> torch.Tensor:
        return self.read_rows(name, 0, self.tensors[name].shape[0])

    def sample(self, row: int, view: SampleView) -> dict:
        got = self.samples([row], view)[row]
        if isinstance(got, CorruptOutputError):
            raise got
        return got

    def samples(self, rows, view: SampleView, alloc=plain_memory) -> dict:
        """Samples ``rows`` (ascending row numbers) from one ranged read of their states, which spans the first to
        the last (rows in between that are not asked for are read and dropped: the caller decides what gap is worth
        it). Each sample is checked against its own checksum: ``{row: reader dict}``, or for a sample that fails,
        ``{row: CorruptOutputError}`` (raise it when that sample's turn comes; the others are intact).

        States come back in memory from ``alloc(nbytes)`` (a uint8 tensor; a sample's tensors are views into it):
        shared memory in a DataLoader worker makes them cross to the training process without a copy. fp8 states
        are read into plain memory and dequantized into ``alloc``'s."""
        cu, h = self.cu_seqlens, self.header
        lo, hi = cu[rows[0]], cu[rows[-1] + 1]
        # The states (and any other large tensor): what is not held.
        read = [n for n in h.per_token if n not in self._held_bytes]
        buffers, hashing = {}, None
        for name in read:
            info = self.tensors[name]
            stored = not (name == "hidden_states" and view.dequantize and view.layout.scaled)
            buffers[name] = buf = (alloc if stored else plain_memory)((hi - lo) * info.row_bytes)
            if (
                self.verify and read == h.per_token[:1]
            ):  # what the checksums cover first: hash it as it arrives
                spans = [
                    (row, (cu[row] - lo) * info.row_bytes, (cu[row + 1] - lo) * info.row_bytes)
                    for row in rows
                ]
                hashing = _Arriving(tensor_bytes(buf), spans)
            _read_into(self.sink, self.key, info.start + lo * info.row_bytes, buf, self.damaged, hashing)
        if hashing is not None:
            hashing.finish()
        out: dict = {}
        for row in rows:
            a, b = cu[row], cu[row + 1]
            parts = {name: held[a:b] for name, held in self._held.items()}
            for name, buf in buffers.items():
                info = self.tensors[name]
                raw = buf[(a - lo) * info.row_bytes : (b - lo) * info.row_bytes]
                parts[name] = raw.view(info.dtype).view(b - a, *info.shape[1:])
            try:
                out[row] = self._sample(row, parts, view, alloc, hashing and hashing.sums[row])
            except CorruptOutputError as e:
                out[row] = e
        return out

    def _sample(
        self, row: int, parts: dict[str, torch.Tensor], view: SampleView, alloc, started=None
    ) -> dict:
        """``started``: this sample's checksum, fed with its states already (``_Arriving``)."""
        a, b = self.cu_seqlens[row], self.cu_seqlens[row + 1]
        if self.verify:
            checksum = started or new_checksum()
            names = self.header.per_token[1:] if started else self.header.per_token
            for name in names:  # the rows of every per-token tensor, in name order
                update_checksum(checksum, tensor_bytes(parts[name]))
            if checksum.hexdigest() != self.header.checksums.samples[row]:
                raise self.damaged(
                    f"sample {self.sample_ids[row]!r} (row {row}, tokens {a}..{b}) does not match its checksum: "
                    "its bytes were altered"
                )
        import torch

        # Slices of the held tensors are copied (the ids and the mask in the dtype served): a view would keep, and
        # send to another process, the whole file's.
        served = {"input_ids": torch.long, "loss_mask": torch.bool}
        tensors = {
            n: t.to(served[n], copy=True) if n in served else t.clone() if n in self._held_bytes else t
            for n, t in parts.items()
        }
        states = tensors.pop("hidden_states")  # [T, slots, H]
        slots = view.layout.slot_layers
        if states.dim() != 3 or states.shape[1] != len(slots):
            raise self.damaged(f"holds states of shape {list(states.shape)} for the layers {list(slots)}")
        scale = tensors.pop("hidden_states_scale", None)  # [T, slots] with fp8 storage
        if view.layout.scaled and (scale is None or tuple(scale.shape) != tuple(states.shape[:2])):
            raise self.damaged("stores fp8 states without a scale for each token of each layer")
        if k := view.layout.target_topk:
            shapes = [tuple(t.shape) for n, t in tensors.items() if n in (TOPK_IDS, TOPK_LOGPROBS)]
            if shapes != [(b - a, k)] * 2:
                raise self.damaged(
                    f"lacks the target's top-{k} ids and log-probabilities the manifest records"
                )
        return Sample(
            {
                **tensors,
                "sample_id": self.sample_ids[row],
                **view.states(states, scale, alloc),
            }
        )


STORED_BY = {
    "final_hidden_state": "--final-state",
    "final_hidden_state_prenorm": "--final-state",
    TOPK_IDS: "--target-topk K",
    TOPK_LOGPROBS: "--target-topk K",
}
"""Keys a reader dict has only when the extraction stored them, and the option that does."""


class NotExtracted(KeyError):
    """A key the extraction did not store; a KeyError, so that ``except KeyError`` and ``.get`` behave as usual."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # its message as written, not KeyError's repr of it


class Sample(dict):
    """A reader dict: a missing key that an extraction option stores says so, instead of a bare KeyError."""

    def __missing__(self, key):
        flag = STORED_BY.get(key)
        if flag is None:
            raise KeyError(key)
        raise NotExtracted(
            f"{key!r}: this output was extracted without {flag}, so its samples have no {key!r}; extract again "
            f"with {flag}" + (" (the eagle3 and dspark presets imply it)" if flag == "--final-state" else "")
        )


@dataclass(frozen=True)
class SampleView:
    """How a sample's stored slots become the keys a trainer reads."""

    layout: StateLayout
    final_norm: FinalNorm | None
    dequantize: bool = True
    dtype: torch.dtype | None = None
    """The dtype fp8 states are dequantized to; None: bfloat16."""
    served: tuple[int, ...] | None = None
    """The layer ids served (``layers``, ``hidden_states``), in this order: a subset of the stored ones (one
    drafter's from a union of presets), or None: every captured layer in id order."""

    def states(self, states: torch.Tensor, scale: torch.Tensor | None, alloc=plain_memory) -> dict:
        """The trainer's keys from the stored slots ``states`` [T, slots, H] (and fp8 ``scale`` [T, slots]); what
        has to be made anew (dequantized states, the served slots without the others) is made in memory from
        ``alloc``."""
        import torch

        from hsextract.output.fp8 import dequantize_fp8

        dtype = self.dtype or torch.bfloat16
        ids = self.served or self.layout.layer_ids
        slot_of = {k: j for j, k in enumerate(self.layout.slot_layers)}
        picked = [slot_of[k] for k in ids]
        tokens = states.shape[0]
        out: dict = {}
        if scale is not None and self.dequantize:
            into = _empty(alloc, states.shape, dtype)
            states, scale = dequantize_fp8(states, scale, dtype, out=into), None
        out["layers"] = {k: states[:, j] for k, j in zip(ids, picked, strict=True)}
        out["hidden_states"] = _slots(states, picked, alloc).view(tokens, -1)
        if scale is not None:
            out["scales"] = {k: scale[:, j] for k, j in zip(ids, picked, strict=True)}
            out["hidden_states_scale"] = _slots(scale, picked, alloc)
        f = self.layout.final_slot
        if f is not None:
            prenorm = states[:, f]
            out["final_hidden_state_prenorm"] = prenorm
            if scale is not None:
                out["final_hidden_state_prenorm_scale"] = scale[:, f]
                prenorm = dequantize_fp8(prenorm, scale[:, f], dtype)
            out["final_hidden_state"] = self.final_norm(prenorm)
        return out


def _slots(x: torch.Tensor, picked: list[int], alloc) -> torch.Tensor:
    """``x[:, picked]`` contiguous: a view where the slots are a contiguous run of every token's whole row, else
    gathered into memory from ``alloc`` (a subset, or the captured slots before the final state's)."""
    a = picked[0]
    if picked == list(range(a, a + len(picked))):
        view = x[:, a : a + len(picked)]
        if view.is_contiguous():
            return view
    out = _empty(alloc, (x.shape[0], len(picked), *x.shape[2:]), x.dtype)
    for i, j in enumerate(picked):
        out[:, i] = x[:, j]
    return out
