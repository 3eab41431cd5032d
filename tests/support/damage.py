"""Real damage to real batch files and manifests, for the tests of output/reader.py and output/verify.py.

Each damage changes a file on disk the way a bad disk, a cut-short copy or a stray write would: a byte flipped at
a chosen place (inside one sample's states, inside its token ids, inside the header JSON), the file truncated or
emptied, the header garbled, a huge or too-large header length, a tensor gone from the header, the file deleted.
Offsets come from the file's own header, so a flip lands where it claims to.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

DAMAGED_ROW = 1
"""The row (sample) of a batch file whose bytes the flips alter; the file's row 0 stays intact."""


def layout(path: Path) -> tuple[dict, int]:
    """A batch file's header (JSON) and the offset where its data section starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def row_offset(path: Path, tensor: str, row: int) -> int:
    """The offset of the first byte of sample ``row``'s rows of ``tensor``."""
    header, base = layout(path)
    start, stop = header["cu_seqlens"]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + start)
        cu = struct.unpack(f"<{(stop - start) // 8}q", f.read(stop - start))
    assert row + 1 < len(cu), f"{path} has {len(cu) - 1} samples, no row {row}"
    entry = header[tensor]
    begin, end = entry["data_offsets"]
    row_bytes = (end - begin) // cu[-1]
    return base + begin + cu[row] * row_bytes


def flip(path: Path, offset: int, mask: int = 0xFF) -> None:
    """The bits of ``mask`` flipped in the byte at ``offset``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def flip_in_states(path: Path) -> None:
    flip(path, row_offset(path, "hidden_states", DAMAGED_ROW) + 6)


def flip_in_ids(path: Path) -> None:
    flip(path, row_offset(path, "input_ids", DAMAGED_ROW))


def flip_in_header(path: Path) -> None:
    """One bit of a metadata letter flipped (p -> P): the header stays valid JSON of the same length."""
    flip(path, path.read_bytes().index(b"output_of_decoder_layer") + 3, mask=0x20)


def truncate_half(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garble_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(8 + 2)
        f.write(b"\xff\x00garbage\x01" * 4)


def huge_header_length(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 60))


def header_beyond_file(path: Path) -> None:
    """A header length under the cap but past the end of the file."""
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 50_000_000))


def drop_loss_mask(path: Path) -> None:
    """The ``loss_mask`` entry removed from the header, padded with spaces to the same length (valid JSON)."""
    header, base = layout(path)
    del header["loss_mask"]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (base - 8 - len(raw))
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(raw)


def delete(path: Path) -> None:
    path.unlink()


@dataclass(frozen=True)
class Damage:
    name: str
    apply: object  # Callable[[Path], None]
    reader_says: str
    """What ``CorruptOutputError`` says when the reader, verifying, reads the damaged row."""
    verify_says: str
    """What ``hsextract verify`` says of the file."""


DAMAGES = [
    Damage(
        "states", flip_in_states, "does not match its checksum", "1 sample(s) do not match their checksums"
    ),
    Damage("ids", flip_in_ids, "does not match its checksum", "1 sample(s) do not match their checksums"),
    Damage("header", flip_in_header, "differs from the one the manifest recorded", "differs from the one"),
    Damage("truncated", truncate_half, "is truncated: it ends at byte", "; the manifest recorded"),
    Damage("empty", empty, "is empty", "has 0 bytes; the manifest recorded"),
    Damage("garbled", garble_header, "differs from the one the manifest recorded", "differs from the one"),
    Damage("huge-header", huge_header_length, "over the 100000000-byte cap", "over the 100000000-byte cap"),
    Damage("header-beyond-file", header_beyond_file, "declares a header of 50000000 bytes", "50000000 bytes"),
    Damage(
        "no-loss-mask", drop_loss_mask, "differs from the one the manifest recorded", "differs from the one"
    ),
    Damage("deleted", delete, "does not exist", "does not exist"),
]


def copy_output(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def manifest_batches(out: Path) -> list[dict]:
    return json.loads((out / "manifest.json").read_text())["batches"]


def truncate_manifest(out: Path) -> None:
    path = out / "manifest.json"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def manifest_without_batches(out: Path) -> None:
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["batches"]
    path.write_text(json.dumps(manifest))


def manifest_key_outside_output(out: Path) -> None:
    """A batch key that climbs out of the output (a garbled or hostile manifest)."""
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["batches"][0]["key"] = "../../etc/passwd"
    path.write_text(json.dumps(manifest))
