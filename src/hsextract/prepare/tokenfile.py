"""The token file: every kept sample's ids and loss mask, written once as the tokenizer's chunks arrive, read back
memory-mapped, so the process preparing a run never holds the tokens.

Renamed into place only after fsync: a token file under its final name is complete. It proves itself: its header
holds the xxh3 of its data and a checksum of the metadata, so an edited id is found whenever the file is mapped
(one pass over its bytes) and the file is tokenized again.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from hsextract.container import arrays, header_bytes, header_json, layout, map_file, read_file_head
from hsextract.errors import HsextractError
from hsextract.storage.fileio import check_not_dir
from hsextract.validation import SEAL_KEY, content_checksum


@dataclass(frozen=True, eq=False)
class TokenizedSamples:
    """All kept samples concatenated: sample ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``."""

    sample_ids: list[str]
    """The row's ``id`` field as a string when present, else the row index."""
    input_ids: np.ndarray
    """int32 token ids of all samples, concatenated."""
    loss_mask: np.ndarray
    """uint8, 1 on tokens the drafter learns to predict (assistant turns), same length as ``input_ids``."""
    offsets: np.ndarray
    """int64, ``len(sample_ids) + 1`` entries, starting at 0 and ending at ``len(input_ids)``."""
    file: Path | None = None
    """The token file these arrays are mapped from, when they are exactly its contents (``save`` links it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sample_ids", [str(s) for s in self.sample_ids])
        object.__setattr__(self, "input_ids", np.ascontiguousarray(self.input_ids, dtype=np.int32))
        object.__setattr__(self, "loss_mask", np.ascontiguousarray(self.loss_mask, dtype=np.uint8))
        object.__setattr__(self, "offsets", np.ascontiguousarray(self.offsets, dtype=np.int64))
        n, ids, offsets = len(self.sample_ids), self.input_ids, self.offsets
        if ids.ndim != 1 or self.loss_mask.shape != ids.shape:
            raise ValueError(f"input_ids {ids.shape} and loss_mask {self.loss_mask.shape} must be equal 1-D")
        if (
            offsets.shape != (n + 1,)
            or offsets[0] != 0
            or offsets[-1] != len(ids)
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError(
                f"offsets must rise from 0 to {len(ids)} with {n + 1} entries, got {offsets[:8]}..."
            )

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample (int64)."""
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, loss_mask)`` of sample ``i``, as views into the concatenated arrays."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[start:end], self.loss_mask[start:end]

    def check_ids_below(
        self,
        vocab_size: int | None,
        advice: str = "its row's input_ids are another model's, or the tokenizer in the model directory is not "
        "this model's",
    ) -> None:
        """Every id names a row of the model's embedding: one that does not would fail the forward far later
        (an ``IndexError`` in a worker, or a device assert)."""
        if vocab_size is None or not len(self.input_ids):
            return
        top, low = int(self.input_ids.max()), int(self.input_ids.min())
        if top < vocab_size and low >= 0:
            return
        bad = top if top >= vocab_size else low
        at = int(np.argmax(self.input_ids == bad))
        sample = self.sample_ids[int(np.searchsorted(self.offsets, at, side="right")) - 1]
        where = f" of {self.file}" if self.file is not None else ""
        raise HsextractError(
            f"sample {sample!r}{where} holds token id {bad}, outside the model's vocabulary of {vocab_size} ids "
            f"(its config.json's vocab_size): {advice}"
        )

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file (tmp + rename: a file under its final name is complete); a hard link when
        these samples are a token file's contents already."""
        path = Path(path)
        check_not_dir(path)
        if self.file is not None:
            tmp = path.with_name(path.name + ".tmp")
            tmp.unlink(missing_ok=True)
            try:
                os.link(self.file, tmp)
            except OSError:
                pass  # another file system: written below
            else:
                os.replace(tmp, path)
                return path
        return self._save(path, {})

    @classmethod
    def load(cls, path: str | Path) -> TokenizedSamples:
        return cls._load(Path(path))[0]

    def _save(self, path: Path, metadata: dict[str, str]) -> Path:
        writer = TokenFileWriter(path)
        step = 1 << 16
        with writer:
            for start in range(0, len(self), step):
                end = min(len(self), start + step)
                a, b = int(self.offsets[start]), int(self.offsets[end])
                writer.add_block(
                    self.sample_ids[start:end],
                    self.lengths[start:end],
                    self.input_ids[a:b],
                    self.loss_mask[a:b],
                )
            writer.finish(metadata)
        return path

    @classmethod
    def _load(cls, path: Path) -> tuple[TokenizedSamples, dict[str, str]]:
        """The arrays memory-mapped (a process reads only the pages it uses; processes share them), ids parsed."""
        tensors, metadata = _map_safetensors(path)
        if metadata.get("format") != "hsextract.tokenized_samples":
            raise HsextractError(f"{path} is not a tokenized-samples file written by hsextract")
        samples = cls(
            sample_ids=json.loads(np.asarray(tensors["sample_ids_json"]).tobytes()),
            input_ids=tensors["input_ids"],
            loss_mask=tensors["loss_mask"],
            offsets=np.array(tensors["offsets"]),
            file=path,
        )
        return samples, metadata


def _map_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A safetensors file's tensors as read-only memory maps, and its metadata."""

    def damaged(why: str) -> HsextractError:
        return HsextractError(f"token file {path} {why}")

    head = read_file_head(path, damaged)
    header = header_json(head, damaged)
    if (problem := _proof_problem(path, header, len(head))) is not None:
        raise damaged(problem)
    metadata = {k: v for k, v in header.pop("__metadata__").items() if k not in (SEAL_KEY, DATA_CHECKSUM)}
    return arrays(map_file(path), header, len(head), damaged), metadata


DATA_CHECKSUM = "data_xxh3"

"""The metadata key holding the xxh3-128 of the file's data (every byte after the header)."""

HASH_CHUNK = 1 << 24


def _header_checksum(header: dict, fields: dict) -> str:
    """The checksum of a token file's header: its metadata ``fields`` and every tensor's place (safetensors keeps
    only tensors beside ``__metadata__``, so the seal lives in the metadata)."""
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    return content_checksum({"metadata": fields, "tensors": tensors})


def _proof_problem(path: Path, header, data_start: int) -> str | None:
    """Why the token file at ``path`` does not prove itself (its sealed header, then its data's checksum), or None."""
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or DATA_CHECKSUM not in metadata:
        return "carries no checksum of its content (written by an older hsextract, or not by hsextract)"
    fields = {k: v for k, v in metadata.items() if k != SEAL_KEY}
    if metadata.get(SEAL_KEY) != _header_checksum(header, fields):
        return "is damaged: its header does not match its checksum (edited or damaged)"
    size = path.stat().st_size - data_start
    ends = [info.get("data_offsets", [0, 0])[1] for name, info in header.items() if name != "__metadata__"]
    if ends and max(ends) != size:
        return f"is damaged: its data holds {size} bytes, its header says {max(ends)}"
    digest = xxhash.xxh3_128()
    if size:  # through a mapping: the pages the arrays map next, no copy
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as whole:
            view = memoryview(whole)
            for start in range(data_start, data_start + size, HASH_CHUNK):
                digest.update(view[start : min(start + HASH_CHUNK, data_start + size)])
            view.release()
    if digest.hexdigest() != metadata[DATA_CHECKSUM]:
        return "is damaged: its data does not match its checksum (an id or a mask edited, or bytes lost)"
    return None


HEADER_RESERVE = 1 << 18

"""Bytes kept for the header ahead of the token ids, which are written before the header is known."""


class TokenFileWriter:
    """Streams samples into a tokenized-samples safetensors file, each byte written once.

    The ids go straight into the file after a reserved header, the mask into a file beside it that is appended at
    the end (the mask is a fifth of the bytes), then the sample ids and offsets, and last the header (padded with
    spaces to the reserve; a longer one moves the data once). The file appears under its name only when
    complete. Layout: ``input_ids`` (I32), ``loss_mask`` (U8), ``sample_ids_json`` (U8, padded so that) ``offsets``
    (I64) start 8-byte aligned.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        check_not_dir(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.mask_tmp = self.path.with_name(self.path.name + ".mask.tmp")
        self.ids_file = open(self.tmp, "wb")
        self.ids_file.seek(8 + HEADER_RESERVE)
        self.mask_file = open(self.mask_tmp, "wb")
        self.sample_ids: list[str] = []
        self.lengths = array("q")
        self.tokens = 0
        self.ids_digest = xxhash.xxh3_128()

    def add_block(self, sample_ids: list[str], lengths, ids: np.ndarray, mask: np.ndarray) -> None:
        """Samples whose ids and masks are concatenated in ``ids`` and ``mask``."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        mask = np.ascontiguousarray(mask, dtype=np.uint8)
        if len(ids) != len(mask) or len(ids) != int(np.sum(lengths, dtype=np.int64)):
            raise ValueError(
                f"{len(ids)} ids, {len(mask)} mask values, {int(np.sum(lengths))} in the lengths"
            )
        self.ids_file.write(memoryview(ids).cast("B"))
        self.ids_digest.update(memoryview(ids).cast("B"))
        self.mask_file.write(memoryview(mask).cast("B"))
        self.sample_ids.extend(str(s) for s in sample_ids)
        self.lengths.extend(int(n) for n in lengths)
        self.tokens += len(ids)

    def finish(self, metadata: dict[str, str]) -> TokenizedSamples:
        """Complete the file, rename it into place and return its samples, mapped."""
        self.mask_file.close()
        digest = self.ids_digest  # the data's checksum, in the file's order: ids, mask, sample ids, offsets
        with open(self.mask_tmp, "rb") as mask:
            while chunk := mask.read(1 << 22):
                self.ids_file.write(chunk)
                digest.update(chunk)
        self.mask_tmp.unlink()
        ids_json = json.dumps(self.sample_ids).encode()
        at = 5 * self.tokens
        ids_json += b" " * (
            -(at + len(ids_json)) % 8
        )  # JSON allows trailing spaces; the offsets follow aligned
        self.ids_file.write(ids_json)
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(self.lengths, dtype=np.int64), out=offsets[1:])
        self.ids_file.write(offsets.tobytes())
        digest.update(ids_json)
        digest.update(offsets.tobytes())
        entries = layout(
            [
                ("input_ids", "I32", [self.tokens]),
                ("loss_mask", "U8", [self.tokens]),
                ("sample_ids_json", "U8", [len(ids_json)]),
                ("offsets", "I64", [len(offsets)]),
            ]
        )
        fields = {"format": "hsextract.tokenized_samples", **metadata, DATA_CHECKSUM: digest.hexdigest()}
        head = header_bytes(
            entries, {**fields, SEAL_KEY: _header_checksum(entries, fields)}, reserve=HEADER_RESERVE
        )
        if len(head) == 8 + HEADER_RESERVE:
            self.ids_file.seek(0)
            self.ids_file.write(head)
            self._close_into_place()
        else:
            self._move_data_after(head)
        self.ids_file = None
        return TokenizedSamples.load(self.path)

    def _close_into_place(self) -> None:
        self.ids_file.flush()
        os.fsync(self.ids_file.fileno())
        self.ids_file.close()
        os.replace(self.tmp, self.path)

    def _move_data_after(self, head: bytes) -> None:
        self.ids_file.close()
        moved = self.path.with_name(self.path.name + ".moved.tmp")
        with open(self.tmp, "rb") as src, open(moved, "wb") as dst:
            dst.write(head)
            src.seek(8 + HEADER_RESERVE)
            shutil.copyfileobj(src, dst, 1 << 22)
            dst.flush()
            os.fsync(dst.fileno())
        self.tmp.unlink()
        os.replace(moved, self.path)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, *exc) -> None:
        """An unfinished file is removed: only a complete one ever has the final name."""
        if self.ids_file is not None:
            self.ids_file.close()
            self.mask_file.close()
            self.tmp.unlink(missing_ok=True)
            self.mask_tmp.unlink(missing_ok=True)
