"""Sinks against a local directory and a real S3 server (SeaweedFS) over HTTP; preflight's error messages."""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
import zlib
from pathlib import Path

import pytest
from support.s3server import S3Endpoint, free_port

from hsextract.errors import HsextractError, StagedFileChanged
from hsextract.storage import open_sink, preflight
from hsextract.storage.base import MiB, Sink, crc32_base64
from hsextract.storage.local import LocalSink
from hsextract.storage.s3 import S3Sink

pytestmark = pytest.mark.usefixtures("aws_test_env")


@pytest.fixture(params=["local", "s3"])
def sink(request: pytest.FixtureRequest, tmp_path: Path) -> Sink:
    if request.param == "local":
        return LocalSink(tmp_path / "out")
    endpoint: S3Endpoint = request.getfixturevalue("s3")
    return S3Sink(request.getfixturevalue("s3_bucket"), "runs/a", endpoint.url)


def _staged(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / "staging" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_sink_round_trip(sink: Sink, tmp_path: Path) -> None:
    data = os.urandom(300_000)
    staged = _staged(tmp_path, "b1", data)
    stored = sink.put_file(staged, "shard-00001/batch-000001.safetensors")
    assert stored.size == len(data)
    assert staged.exists(), "the staged file is the caller's to delete"
    sink.put_file(_staged(tmp_path, "b0", b"x" * 10), "shard-00001/batch-000000.safetensors")
    sink.put_file(_staged(tmp_path, "e", b""), "shard-00002/batch-000000.safetensors")
    sink.put_bytes("shard-00001/index.json", b"{}")

    assert sink.get_bytes("shard-00001/batch-000001.safetensors") == data
    assert sink.read_range("shard-00001/batch-000001.safetensors", 1000, 5000) == data[1000:6000]
    assert sink.read_range("shard-00001/batch-000001.safetensors", len(data) - 10, 100) == data[-10:]
    assert sink.read_range("shard-00001/batch-000001.safetensors", len(data), 100) == b""
    # Into a caller's buffer: exactly the range, fewer bytes at the end, none past it.
    buf = bytearray(b"\xee" * 5000)
    assert sink.read_range_into("shard-00001/batch-000001.safetensors", 1000, memoryview(buf)[:4000]) == 4000
    assert buf[:4000] == data[1000:5000] and buf[4000:] == b"\xee" * 1000
    assert sink.read_range_into("shard-00001/batch-000001.safetensors", len(data) - 10, buf) == 10
    assert buf[:10] == data[-10:]
    assert sink.read_range_into("shard-00001/batch-000001.safetensors", len(data), buf) == 0
    with pytest.raises(FileNotFoundError):
        sink.read_range_into("shard-00001/nothing", 0, buf)
    # Told as the bytes arrive, in order, up to all of them.
    arrived: list[tuple[int, int]] = []
    whole = bytearray(len(data))
    assert sink.read_range_into(
        "shard-00001/batch-000001.safetensors", 0, whole, lambda a, b: arrived.append((a, b))
    ) == len(data)
    assert whole == data and arrived[0][0] == 0 and arrived[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(arrived, arrived[1:], strict=False))
    assert sink.size("shard-00001/batch-000001.safetensors") == len(data)
    assert sink.size("shard-00002/batch-000000.safetensors") == 0
    assert sink.exists("shard-00001/index.json")
    assert not sink.exists("shard-00001/nothing")
    assert sink.list_keys() == [
        "shard-00001/batch-000000.safetensors",
        "shard-00001/batch-000001.safetensors",
        "shard-00001/index.json",
        "shard-00002/batch-000000.safetensors",
    ]
    assert sink.list_keys("shard-00001/batch") == [
        "shard-00001/batch-000000.safetensors",
        "shard-00001/batch-000001.safetensors",
    ]
    assert sink.list_keys("shard-00003/") == []

    # Overwriting a key is allowed (a rerun uploads a batch again).
    sink.put_file(_staged(tmp_path, "b1-again", b"new"), "shard-00001/batch-000001.safetensors")
    assert sink.get_bytes("shard-00001/batch-000001.safetensors") == b"new"

    sink.delete("shard-00001/index.json")
    sink.delete("shard-00001/index.json")  # deleting twice is not an error
    assert not sink.exists("shard-00001/index.json")
    with pytest.raises(FileNotFoundError):
        sink.get_bytes("shard-00001/index.json")
    with pytest.raises(FileNotFoundError):
        sink.size("shard-00001/index.json")


def test_local_sink_leaves_no_temporary_files_and_hides_stale_ones(tmp_path: Path) -> None:
    sink = LocalSink(tmp_path / "out")
    sink.put_file(_staged(tmp_path, "b", b"abc"), "shard-00000/batch-000000.safetensors")
    assert sorted(p.name for p in (tmp_path / "out" / "shard-00000").iterdir()) == [
        "batch-000000.safetensors"
    ]
    # What a crash in the middle of a copy leaves behind is not a key.
    (tmp_path / "out" / "shard-00000" / "batch-000001.safetensors.tmp-123-456").write_bytes(b"partial")
    assert sink.list_keys() == ["shard-00000/batch-000000.safetensors"]


def test_s3_objects_live_under_the_prefix(s3: S3Endpoint, s3_bucket: str, tmp_path: Path) -> None:
    sink = open_sink(f"s3://{s3_bucket}/runs/a/", s3.url)
    sink.put_file(_staged(tmp_path, "b", b"abc"), "shard-00000/batch-000000.safetensors")
    assert s3.object_keys(s3_bucket) == ["runs/a/shard-00000/batch-000000.safetensors"]
    assert sink.url == f"s3://{s3_bucket}/runs/a"


@pytest.mark.slow  # 2-3 s: the fast tier's budget (60 s on 2 cores)
def test_s3_multipart_upload_is_byte_identical(s3: S3Endpoint, s3_bucket: str, tmp_path: Path) -> None:
    data = os.urandom(20 * MiB + 12345)
    sink = S3Sink(
        s3_bucket, "", s3.url, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4
    )
    stored = sink.put_file(_staged(tmp_path, "big", data), "shard-00000/batch-000000.safetensors")
    head = s3.client().head_object(Bucket=s3_bucket, Key="shard-00000/batch-000000.safetensors")
    assert head["ETag"].endswith('-5"'), "uploaded in 5 parts"
    assert stored.size == len(data)
    assert s3.get_object(s3_bucket, "shard-00000/batch-000000.safetensors") == data


def test_the_test_s3_server_refuses_wrong_checksums_and_serves_just_the_range(
    s3: S3Endpoint, s3_bucket: str
) -> None:
    """What the sink's checks rely on, shown of the server the tests use (moto accepted both wrong checksums)."""
    from botocore.exceptions import ClientError

    client = s3.client()
    data = os.urandom(300_000)
    wrong_crc32 = crc32_base64(zlib.crc32(data) ^ 1)
    wrong_md5 = base64.b64encode(hashlib.md5(data[1:]).digest()).decode()
    for header in ({"ChecksumCRC32": wrong_crc32}, {"ContentMD5": wrong_md5}):
        with pytest.raises(ClientError, match="BadDigest"):
            client.put_object(Bucket=s3_bucket, Key="k", Body=data, **header)
    assert s3.object_keys(s3_bucket) == []
    client.put_object(Bucket=s3_bucket, Key="k", Body=data, ChecksumCRC32=crc32_base64(zlib.crc32(data)))
    head = client.head_object(Bucket=s3_bucket, Key="k", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"] == crc32_base64(zlib.crc32(data))
    got = client.get_object(Bucket=s3_bucket, Key="k", Range="bytes=1000-5999")
    assert (got["ContentLength"], got["ContentRange"]) == (5000, f"bytes 1000-5999/{len(data)}")
    assert got["Body"].read() == data[1000:6000]


@pytest.mark.parametrize("store", ["local", "s3", "s3-multipart"])
def test_a_file_whose_bytes_are_not_its_writers_is_refused_and_nothing_is_stored(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The writer's CRC32 against the bytes sent (one byte changed, the size kept): what a staged file altered
    while it waited looks like to the sink."""
    if store == "local":
        sink: Sink = LocalSink(tmp_path / "out")
    else:
        endpoint: S3Endpoint = request.getfixturevalue("s3")
        sink = S3Sink(
            request.getfixturevalue("s3_bucket"),
            "",
            endpoint.url,
            multipart_threshold=5 * MiB,
            multipart_chunksize=5 * MiB,
        )
    data = bytearray(os.urandom(12 * MiB if store == "s3-multipart" else 300_000))
    written = zlib.crc32(data)
    key = "shard-00000/batch-000000.safetensors"
    assert sink.put_file(_staged(tmp_path, "good", bytes(data)), key, expected_crc32=written).crc32 == written
    sink.delete(key)
    data[len(data) // 2] ^= 0x01
    with pytest.raises(
        StagedFileChanged,
        match=f"the bytes read to upload it have CRC32 {zlib.crc32(data):08x}, "
        f"its writer wrote {written:08x}; not uploaded",
    ):
        sink.put_file(_staged(tmp_path, "changed", bytes(data)), key, expected_crc32=written)
    assert not sink.exists(key) and sink.list_keys() == []
    if store == "local":
        assert not list((tmp_path / "out").rglob("*.tmp-*"))


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_s3_endpoint_from_environment(
    s3: S3Endpoint, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, s3.url)
    sink = open_sink(f"s3://{s3_bucket}")
    assert sink.endpoint == s3.url
    sink.put_bytes("k", b"v")
    assert s3.get_object(s3_bucket, "k") == b"v"


def test_open_sink_parses_output_strings(tmp_path: Path) -> None:
    s3_sink = open_sink("s3://bucket/some/prefix/", "http://127.0.0.1:1")
    assert isinstance(s3_sink, S3Sink)
    assert (s3_sink.bucket, s3_sink.prefix) == ("bucket", "some/prefix")
    assert open_sink("s3://bucket", "http://127.0.0.1:1").prefix == ""
    assert isinstance(open_sink(str(tmp_path)), LocalSink)
    assert open_sink(f"file://{tmp_path}").root == tmp_path
    with pytest.raises(HsextractError, match="names no bucket"):
        open_sink("s3://")
    with pytest.raises(HsextractError, match="unsupported scheme 'gs://'"):
        open_sink("gs://bucket/x")


@pytest.mark.slow  # waits out retries and deadlines in real time
def test_s3_put_file_retries_until_the_endpoint_is_back(
    s3: S3Endpoint, s3_bucket: str, tmp_path: Path
) -> None:
    sink = S3Sink(s3_bucket, "", s3.url)
    data = os.urandom(100_000)
    s3.stop()
    restart = threading.Timer(2.0, s3.start)
    restart.start()
    try:
        sink.put_file(_staged(tmp_path, "b", data), "batch")
    finally:
        restart.join()
    assert s3.get_object(s3_bucket, "batch") == data


@pytest.mark.slow  # waits out retries and deadlines in real time
def test_s3_put_file_gives_up_at_the_deadline(tmp_path: Path) -> None:
    sink = S3Sink("bucket", "", f"http://127.0.0.1:{free_port()}", retry_deadline_s=2)
    start = time.monotonic()
    with pytest.raises(
        HsextractError, match="gave up on the upload of batch .* could not reach http://127.0.0.1"
    ):
        sink.put_file(_staged(tmp_path, "b", b"abc"), "batch")
    assert time.monotonic() - start < 10


def test_s3_put_file_does_not_retry_a_missing_bucket(s3: S3Endpoint, tmp_path: Path) -> None:
    sink = S3Sink("no-such-bucket", "", s3.url)
    start = time.monotonic()
    with pytest.raises(HsextractError, match="bucket 'no-such-bucket' does not exist"):
        sink.put_file(_staged(tmp_path, "b", b"abc"), "batch")
    assert time.monotonic() - start < 5


def test_preflight_passes_and_leaves_no_probe(s3: S3Endpoint, s3_bucket: str, tmp_path: Path) -> None:
    preflight(f"s3://{s3_bucket}/run", s3.url)
    assert s3.object_keys(s3_bucket) == []
    preflight(str(tmp_path / "new" / "dir"))
    assert list((tmp_path / "new" / "dir").iterdir()) == []


def test_preflight_missing_bucket(s3: S3Endpoint) -> None:
    with pytest.raises(HsextractError, match=f"bucket 'no-such-bucket' does not exist at {s3.url}"):
        preflight("s3://no-such-bucket/run", s3.url)


def test_preflight_refused_credentials(
    s3: S3Endpoint, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = s3.create_credentials()
    denied = s3.create_credentials(allow_s3=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with pytest.raises(
        HsextractError, match=r"credentials were refused .*InvalidAccessKeyId.*AWS_ACCESS_KEY_ID"
    ):
        preflight(f"s3://{s3_bucket}", s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", good["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(HsextractError, match=r"credentials were refused .*SignatureDoesNotMatch"):
        preflight(f"s3://{s3_bucket}", s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", denied["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", denied["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(HsextractError, match=f"access to s3://{s3_bucket} was denied"):
        preflight(f"s3://{s3_bucket}", s3.url)
    for name, value in good.items():
        monkeypatch.setenv(name, value)
    preflight(f"s3://{s3_bucket}", s3.url)


def test_preflight_without_credentials(
    s3: S3Endpoint, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    start = time.monotonic()
    with pytest.raises(HsextractError, match="no usable AWS credentials .*AWS_ACCESS_KEY_ID"):
        preflight(f"s3://{s3_bucket}", s3.url)
    assert time.monotonic() - start < 20


@pytest.mark.slow  # waits out retries and deadlines in real time
def test_preflight_unreachable_endpoint() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(HsextractError, match=f"could not reach {endpoint}"):
        preflight("s3://bucket/run", endpoint)
    assert time.monotonic() - start < 20


def test_preflight_unwritable_directory(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    # A path below a regular file cannot be created, even by root (who ignores permission bits).
    with pytest.raises(HsextractError, match="cannot create the output directory"):
        preflight(str(tmp_path / "a-file" / "out"))


def test_discard_partials_aborts_open_multipart_uploads_of_the_prefix_only(
    s3: S3Endpoint, s3_bucket: str
) -> None:
    sink = S3Sink(s3_bucket, "runs/a", s3.url)
    client = sink._client
    mine = client.create_multipart_upload(Bucket=s3_bucket, Key="runs/a/shard-00001/batch-000003.safetensors")
    other = client.create_multipart_upload(
        Bucket=s3_bucket, Key="runs/a/shard-00002/batch-000004.safetensors"
    )
    assert sink.discard_partials("shard-00001/") == 1
    left = [u["UploadId"] for u in client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])]
    assert mine["UploadId"] not in left and other["UploadId"] in left


def test_local_discard_partials_removes_only_unfinished_copies(tmp_path: Path) -> None:
    sink = LocalSink(tmp_path)
    (tmp_path / "shard-00001").mkdir()
    (tmp_path / "shard-00001" / "batch-000001.safetensors").write_bytes(b"done")
    (tmp_path / "shard-00001" / "batch-000002.safetensors.tmp-1-2").write_bytes(b"half")
    (tmp_path / "shard-00002").mkdir()
    (tmp_path / "shard-00002" / "batch-000005.safetensors.tmp-1-2").write_bytes(b"other shard")
    assert sink.discard_partials("shard-00001/") == 1
    assert sink.list_keys() == ["shard-00001/batch-000001.safetensors"]
    assert (tmp_path / "shard-00002" / "batch-000005.safetensors.tmp-1-2").exists()


def test_a_directory_where_hsextract_keeps_a_file_is_named_not_removed(tmp_path):
    from hsextract.prepare.tokenfile import TokenizedSamples
    from hsextract.storage.fileio import write_json

    for name, write in (
        ("run.json", lambda path: write_json(path, {"a": 1})),
        ("tokens.safetensors", TokenizedSamples(["a"], [1, 2], [0, 1], [0, 2]).save),
    ):
        (tmp_path / name / "theirs").mkdir(parents=True)
        with pytest.raises(
            HsextractError, match=f"{tmp_path / name} is a directory where hsextract keeps a file"
        ):
            write(tmp_path / name)
        assert (tmp_path / name / "theirs").is_dir()  # was: IsADirectoryError, a traceback
