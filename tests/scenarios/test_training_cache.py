"""``cache_dir=``: epochs after the first read a local disk cache instead of S3. The S3 server on loopback is stopped
after the first epoch, so a second epoch that completes made no request; its items are compared with the same
epoch read from the local output."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import xxhash
from support import damage
from support.compare import assert_same
from support.s3server import S3Endpoint
from torch.utils.data import DataLoader

from hsextract.errors import CorruptOutputError
from hsextract.training import StatesDataset, StatesMapDataset

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("aws_test_env")]


def as_list(batch):
    return batch


def epoch(data: StatesDataset, e: int, workers: int = 2) -> list[dict]:
    data.set_epoch(e)
    return [s for b in DataLoader(data, batch_size=2, num_workers=workers, collate_fn=as_list) for s in b]


def block_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file() and p.name.isdigit())


@pytest.fixture
def remote(finished_run, s3: S3Endpoint, s3_bucket) -> str:
    out = finished_run[0] / "out"
    client = s3.client()
    for path in sorted(out.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), s3_bucket, f"run/{path.relative_to(out).as_posix()}")
    return f"s3://{s3_bucket}/run"


def test_a_second_epoch_is_read_from_the_cache_with_the_s3_server_stopped(finished_run, s3, remote, tmp_path):
    out = finished_run[0] / "out"
    cache = tmp_path / "cache"
    data = StatesDataset(
        remote, endpoint_url=s3.url, seed=4, batch_size=2, cache_dir=str(cache), cache_max_gb=1
    )
    first = epoch(data, 0)
    stored = sum(p.stat().st_size for p in block_files(cache))
    assert stored >= sum(p.stat().st_size for p in out.rglob("*.safetensors") if "shard-" in str(p))
    s3.stop()
    with pytest.raises(ConnectionRefusedError):  # the server is really gone
        socket.create_connection(("127.0.0.1", s3.port), timeout=5)
    second = epoch(data, 1)  # new DataLoader workers, which open the output again: all from the cache
    s3.start()
    local = StatesDataset(out, seed=4, batch_size=2)
    assert len(first) == len(second) == len(local.index)
    for e, got in ((0, first), (1, second)):
        want = epoch(local, e)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b, a["sample_id"])
    assert sum(p.stat().st_size for p in block_files(cache)) == stored  # nothing fetched twice


def test_cached_bytes_are_still_checked_by_the_reader(finished_run, s3, remote, tmp_path):
    """A block altered together with its own checksum passes the cache, not the reader: the batch file's header
    and sample checksums still catch it, naming the file."""
    out = finished_run[0] / "out"
    cache = tmp_path / "cache"
    data = StatesMapDataset(remote, endpoint_url=s3.url, cache_dir=str(cache))
    for i in range(len(data)):
        data[i]
    i = next(i for i, r in enumerate(data.index.rows) if r == damage.DAMAGED_ROW)
    key = data.index.keys[i]
    offset = damage.row_offset(out / key, "hidden_states", damage.DAMAGED_ROW) + 6
    (block,) = [p for p in block_files(cache) if p.parent.parent.as_posix().endswith(key)]
    assert offset < block.stat().st_size - 8  # one block holds this tiny file
    raw = bytearray(block.read_bytes()[:-8])
    raw[offset] ^= 0xFF
    block.write_bytes(bytes(raw) + xxhash.xxh3_64(raw).digest())
    fresh = StatesMapDataset(remote, endpoint_url=s3.url, cache_dir=str(cache))
    with pytest.raises(CorruptOutputError, match=f"{key}.*does not match its checksum"):
        fresh[i]


def test_a_dataset_whose_cache_is_a_shared_folder_removes_only_the_caches_own(finished_run, tmp_path):
    """The reproduction: a tiny cache limit in a folder that also holds the user's projects and a link; another
    output's cache folder there makes room, the user's things stay byte for byte."""
    out = finished_run[0] / "out"
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    (shared / "my_project").mkdir(parents=True)
    (shared / "my_project" / "train.py").write_text("print('mine')")
    (shared / "notes").mkdir()
    (shared / "notes" / "00000000").write_bytes(b"a note named like a block")
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("elsewhere")
    (shared / "link").symlink_to(elsewhere)
    before = {p: p.read_bytes() for p in (*shared.rglob("*"), *elsewhere.rglob("*")) if p.is_file()}
    copy = tmp_path / "copy"  # a second output, cached first
    shutil.copytree(out, copy)
    other = StatesMapDataset(copy, cache_dir=str(shared), cache_max_gb=1)
    for i in range(len(other)):
        other[i]
    [other_folder] = [p for p in shared.iterdir() if p.is_dir() and (p / ".hsextract-cache").is_file()]
    data = StatesDataset(out, seed=4, batch_size=2, cache_dir=str(shared), cache_max_gb=0.001)
    assert len(epoch(data, 0, workers=0)) == len(data.index)
    assert not other_folder.exists()
    assert {p: p.read_bytes() for p in before if p.is_file()} == before
    assert sorted(p.name for p in shared.iterdir() if not (p / ".hsextract-cache").is_file()) == [
        ".hsextract-cache-lock",
        ".hsextract-cache-usage",
        "link",
        "my_project",
        "notes",
    ]
