"""storage/cache.py: the block cache over a real local sink; the reference is the file's own bytes."""

import logging
import random

import pytest

from hsextract.errors import HsextractError
from hsextract.storage.cache import BLOCK_BYTES, CachedSink
from hsextract.storage.local import LocalSink

SIZE = 3 * BLOCK_BYTES + 12345


@pytest.fixture
def source(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    content = random.Random(0).randbytes(SIZE)
    (root / "a.bin").write_bytes(content)
    (root / "b.txt").write_bytes(b"not cached")
    return root, content


def versions(tag="t1"):
    return lambda key: (tag, SIZE) if key == "a.bin" else None


RANGES = [
    (0, 10),
    (BLOCK_BYTES - 5, 10),
    (BLOCK_BYTES, BLOCK_BYTES),
    (5, 2 * BLOCK_BYTES + 7),
    (SIZE - 3, 10),
]
_rng = random.Random(1)
RANGES += [(_rng.randrange(SIZE), _rng.randrange(1, 2 * BLOCK_BYTES)) for _ in range(5)]


def block_files(cache):
    return sorted(p for p in cache.rglob("*") if p.is_file() and p.name.isdigit())


def test_ranges_read_through_the_cache_equal_the_file_and_need_it_no_more(source, tmp_path):
    root, content = source
    cache = tmp_path / "cache"
    sink = CachedSink(LocalSink(root), cache, 100 * BLOCK_BYTES, versions())
    for offset, length in [*RANGES, (0, SIZE)]:
        assert bytes(sink.read_range("a.bin", offset, length)) == content[offset : offset + length]
    assert sink.get_bytes("b.txt") == b"not cached"  # not versioned: straight from the sink
    buffer = bytearray(BLOCK_BYTES + 10)
    assert sink.read_range_into("a.bin", 7, buffer) == len(buffer) and buffer == content[7 : 7 + len(buffer)]
    assert len(block_files(cache)) == 4
    (root / "a.bin").unlink()
    again = CachedSink(LocalSink(root), cache, 100 * BLOCK_BYTES, versions())  # as another process
    for offset, length in RANGES:
        assert bytes(again.read_range("a.bin", offset, length)) == content[offset : offset + length]
    assert again.get_bytes("a.bin") == content
    with pytest.raises(FileNotFoundError):  # another version of the file: not served from the old blocks
        CachedSink(LocalSink(root), cache, 100 * BLOCK_BYTES, versions("t2")).read_range("a.bin", 0, 10)


def test_a_damaged_or_torn_block_is_dropped_and_fetched_again(source, tmp_path, caplog):
    root, content = source
    cache = tmp_path / "cache"
    sink = CachedSink(LocalSink(root), cache, 100 * BLOCK_BYTES, versions())
    sink.get_bytes("a.bin")
    blocks = block_files(cache)
    good = [p.read_bytes() for p in blocks]
    flipped = bytearray(good[1])
    flipped[100] ^= 0x40
    blocks[1].write_bytes(flipped)
    blocks[3].write_bytes(good[3][:-20])  # torn
    with caplog.at_level(logging.WARNING, logger="hsextract.storage.cache"):
        assert sink.get_bytes("a.bin") == content
    assert sum("is damaged" in r.getMessage() for r in caplog.records) == 2
    assert [p.read_bytes() for p in blocks] == good


def test_the_limit_holds_and_other_outputs_make_room_for_this_one(source, tmp_path):
    root, content = source
    cache = tmp_path / "cache"
    small = CachedSink(LocalSink(root), cache, int(2.5 * BLOCK_BYTES), versions(), identity="A")
    assert small.get_bytes("a.bin") == content  # what does not fit is read through
    assert sum(p.stat().st_size for p in block_files(cache)) <= 2.5 * BLOCK_BYTES
    assert len(block_files(cache)) == 2
    assert int((cache / "usage").read_text()) == sum(p.stat().st_size for p in block_files(cache))
    # Another output with a limit that fits only itself: output A's blocks go, B's stay.
    b = CachedSink(LocalSink(root), cache, 4 * BLOCK_BYTES + 100, versions(), identity="B")
    assert b.get_bytes("a.bin") == content
    assert not small.root.exists() and len(block_files(b.root)) == 4
    assert int((cache / "usage").read_text()) == sum(p.stat().st_size for p in block_files(cache))
    with pytest.raises(HsextractError, match="needs room"):
        CachedSink(LocalSink(root), cache, 0, versions())
