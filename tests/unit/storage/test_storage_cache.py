"""storage/cache.py: the block cache over a real local sink; the reference is the file's own bytes."""

import logging
import math
import os
import random
from pathlib import Path

import pytest
from support.fs import mounted_tmpfs

from hsextract.errors import HsextractError
from hsextract.storage.cache import BLOCK_BYTES, MARKER, USAGE, CachedSink, cache_limit
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


def usage_count(cache) -> int:
    return int((cache / USAGE).read_text().split()[0])


def tree(root: Path) -> dict:
    """Every entry under ``root`` (links not followed): a file's bytes, a link's target, a folder as None."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = None
            else:
                out[rel] = path.read_bytes()
    return out


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
    assert usage_count(cache) == sum(p.stat().st_size for p in block_files(cache))
    # Another output with a limit that fits only itself: output A's blocks go, B's stay.
    b = CachedSink(LocalSink(root), cache, 4 * BLOCK_BYTES + 100, versions(), identity="B")
    assert b.get_bytes("a.bin") == content
    assert not small.root.exists() and len(block_files(b.root)) == 4
    assert usage_count(cache) == sum(p.stat().st_size for p in block_files(cache))
    with pytest.raises(HsextractError, match="needs room"):
        CachedSink(LocalSink(root), cache, 0, versions())


def test_the_cache_removes_only_the_folders_it_made_never_the_users_or_through_a_link(source, tmp_path):
    """A shared folder as cache_dir: the user's projects, a folder named like a cache folder but not marked as
    one, links to elsewhere and a file named like the old usage file are all left as they were; only the other
    output's cache folder makes room."""
    root, content = source
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    for d, files in {
        shared / "my_project": {"train.py": b"print(1)", "00000001": b"x" * BLOCK_BYTES},
        shared / "notes": {"todo.txt": b"buy milk"},
        shared / "0123456789abcdef": {"00000000": b"y" * BLOCK_BYTES},  # the naming, not the marker
        elsewhere / "data": {"00000000": b"z" * BLOCK_BYTES, MARKER: b"not this one"},
    }.items():
        d.mkdir(parents=True)
        for name, data in files.items():
            (d / name).write_bytes(data)
    (shared / "usage").write_text("my own usage notes")
    (shared / "link").symlink_to(elsewhere / "data")
    (shared / "fedcba9876543210").symlink_to(elsewhere / "data")  # a link named like a cache folder
    users = tree(shared)
    theirs = tree(elsewhere)

    other = CachedSink(LocalSink(root), shared, 100 * BLOCK_BYTES, versions(), identity="B")
    assert other.get_bytes("a.bin") == content
    assert other.root.is_dir() and len(block_files(other.root)) == 4
    # An output whose limit holds only itself: the other output's blocks go, nothing else does.
    mine = CachedSink(LocalSink(root), shared, 4 * BLOCK_BYTES + 100, versions(), identity="A")
    assert mine.get_bytes("a.bin") == content
    assert not other.root.exists() and len(block_files(mine.root)) == 4
    left = tree(shared)
    assert {k: v for k, v in left.items() if not k.startswith((mine.root.name, ".hsextract-cache"))} == users
    assert tree(elsewhere) == theirs
    assert usage_count(shared) == sum(p.stat().st_size for p in block_files(mine.root))


@pytest.mark.parametrize("tampered", ["-100000000000", "0", "12 deadbeef", "not a number"])
def test_a_tampered_usage_count_does_not_let_the_cache_pass_its_limit(source, tmp_path, tampered, caplog):
    root, content = source
    cache = tmp_path / "cache"
    limit = int(2.5 * BLOCK_BYTES)
    first = CachedSink(LocalSink(root), cache, limit, versions(), identity="A")
    assert first.get_bytes("a.bin") == content
    stored = sum(p.stat().st_size for p in block_files(cache))
    assert stored <= limit
    (cache / USAGE).write_text(tampered)
    with caplog.at_level(logging.WARNING, logger="hsextract.storage.cache"):
        again = CachedSink(LocalSink(root), cache, limit, versions("t2"), identity="A")
        assert again.get_bytes("a.bin") == content
    assert sum(p.stat().st_size for p in block_files(cache)) <= limit
    assert any("counted again" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, 0, 1e-12, "1", True, None])
def test_a_cache_limit_that_is_not_a_positive_finite_number_is_refused_by_name(bad):
    with pytest.raises(HsextractError, match="cache_max_gb must be a positive, finite number") as e:
        cache_limit(bad)
    assert repr(bad) in str(e.value)
    assert cache_limit(0.5) == 500_000_000


def test_a_directory_in_place_of_a_block_is_the_caches_damage_and_is_repaired(source, tmp_path, caplog):
    root, content = source
    cache = tmp_path / "cache"
    sink = CachedSink(LocalSink(root), cache, 100 * BLOCK_BYTES, versions())
    sink.get_bytes("a.bin")
    blocks = block_files(cache)
    good = blocks[1].read_bytes()
    blocks[1].unlink()
    blocks[1].mkdir()
    (blocks[1] / "something").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="hsextract.storage.cache"):
        assert sink.get_bytes("a.bin") == content
    assert any(
        "is a directory" in r.getMessage() and str(blocks[1]) in r.getMessage() for r in caplog.records
    )
    assert blocks[1].is_file() and blocks[1].read_bytes() == good


def test_a_link_inside_the_cache_folder_is_never_written_through(source, tmp_path):
    root, content = source
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    sink = CachedSink(LocalSink(root), cache, 100 * BLOCK_BYTES, versions())
    (sink.root / "a.bin").mkdir(parents=True)
    (sink.root / "a.bin" / "t1").symlink_to(outside)
    assert sink.get_bytes("a.bin") == content
    assert list(outside.iterdir()) == []


@pytest.fixture
def full_fs(tmp_path):
    """A real, separately mounted tmpfs filled to the last byte (root, as CI has)."""
    with mounted_tmpfs(tmp_path / "full-fs", "4m") as where:
        (where / "cache").mkdir()
        with open(where / "ballast", "wb", buffering=0) as f:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        f.write(bytes(size))
                except OSError:
                    pass
        yield where


def test_a_cache_on_a_full_disk_reads_through_with_a_warning(source, full_fs, caplog):
    root, content = source
    with caplog.at_level(logging.WARNING, logger="hsextract.storage.cache"):
        sink = CachedSink(LocalSink(root), full_fs / "cache", 100 * BLOCK_BYTES, versions())
        for offset, length in RANGES:
            assert bytes(sink.read_range("a.bin", offset, length)) == content[offset : offset + length]
        assert sink.get_bytes("a.bin") == content
    assert block_files(full_fs / "cache") == []
    warned = [r.getMessage() for r in caplog.records if "cannot store blocks" in r.getMessage()]
    assert len(warned) == 1 and "No space left" in warned[0]
