"""An ``s3://bucket/key-or-prefix`` data source: its data files fetched once into the run dir's cache.

Each object is downloaded to ``<cache>/s3/<bucket>/<key>`` (temporary name, then renamed) with its ETag and size
beside it; a later run fetches it again only when either changed. The identity recorded for the plan is the list
of (key, size, ETag), so a changed object is a changed source. Credentials, region and endpoint come from the same
chain as the output's (storage.s3: ``--s3-endpoint-url``, ``AWS_ENDPOINT_URL_S3``, boto3's standard chain).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.prepare.rows import (
    DATA_SUFFIXES,
    REGENERATE_SETTINGS,
    REGENERATED_CHUNK,
    file_format,
    is_regenerate_output,
    regenerated_summary,
)
from hsextract.storage.fileio import write_json

log = logging.getLogger(__name__)


def fetch_s3_files(
    location: str, label: str, cache_dir: Path | None, endpoint_url: str | None
) -> tuple[list[Path], dict]:
    """Local copies of the data files at ``location`` (one key, or every data file under a prefix) and their
    identity."""
    from hsextract.storage.s3 import S3Sink

    bucket, _, key = location[len("s3://") :].partition("/")
    if not bucket:
        raise HsextractError(f"data source {label} names no bucket: write s3://BUCKET/KEY-OR-PREFIX")
    # Short timeouts and retry budget: like the output's preflight, a bad source must fail in seconds.
    sink = S3Sink(
        bucket,
        "",
        endpoint_url,
        retry_deadline_s=10.0,
        connect_timeout_s=3.0,
        read_timeout_s=30.0,
        botocore_max_attempts=2,
    )
    try:
        keys = _data_keys(sink, key)
        if not keys:
            raise HsextractError(
                f"no data file at {location} (keys ending in {', '.join(DATA_SUFFIXES)}): check the key or prefix"
            )
        root = Path(cache_dir) if cache_dir is not None else Path(tempfile.mkdtemp(prefix="hsextract-s3-"))
        files, objects = [], []
        for k in keys:
            info = sink.object_info(k)
            if info is None:
                raise HsextractError(f"s3://{bucket}/{k} vanished while the source was read: rerun")
            files.append(_fetched(sink, k, info, root / "s3" / bucket / k))
            objects.append({"key": k, **info})
    except HsextractError as e:
        raise HsextractError(f"data source {label}: {e}") from None
    identity = {"kind": "s3", "bucket": bucket, "objects": objects}
    if regenerated := _regenerated(sink, key, location):
        identity["regenerated"] = regenerated
    return files, identity


def _data_keys(sink, key: str) -> list[str]:
    if key and file_format(Path(key)) and sink.object_info(key) is not None:
        return [key]
    prefix = key if not key or key.endswith("/") else key + "/"
    listed = sink.list_keys(prefix)
    keys = [k for k in listed if file_format(Path(k))]
    if is_regenerate_output(k[len(prefix) :] for k in listed):  # its chunks, never its records
        keys = [k for k in keys if REGENERATED_CHUNK.match(k[len(prefix) :])]
    return keys


def _regenerated(sink, key: str, location: str) -> dict | None:
    prefix = key if not key or key.endswith("/") else key + "/"
    try:
        return regenerated_summary(
            sink.get_bytes(prefix + REGENERATE_SETTINGS), location + "/" + REGENERATE_SETTINGS
        )
    except FileNotFoundError:
        return None


def _fetched(sink, key: str, info: dict, path: Path) -> Path:
    stamp = path.with_name(path.name + ".etag.json")
    if path.is_file() and stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == info and path.stat().st_size == info["size"]:
                return path
        except (OSError, ValueError):
            pass  # an unreadable stamp costs a download
    log.info("fetching s3://%s/%s (%d bytes) into %s", sink.bucket, key, info["size"], path)
    sink.get_file(key, path)
    write_json(stamp, info)
    return path
