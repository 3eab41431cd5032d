"""Output on S3 (or an S3-compatible store): the ``S3Sink`` behind base.py's ``Sink`` interface.

Every upload carries the writer's CRC32 and is checked by a HEAD after it. One hand-written retry loop runs to a
deadline (``retry_deadline_s``), because botocore's own retries give up within seconds: outages are waited out,
while what waiting cannot fix raises at once. docs/ARCHITECTURE.md ("Uploads to S3") has the details.
"""

from __future__ import annotations

import base64
import logging
import os
import random
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hsextract.errors import HsextractError, redact
from hsextract.storage.base import (
    DEFAULT_RETRY_DEADLINE_S,
    FIRST_BACKOFF_S,
    MAX_BACKOFF_S,
    PROBE_PREFIX,
    MiB,
    Sink,
    StoredObject,
    changed_file,
    check_key,
    crc32_base64,
    fill,
    read_range_via_into,
    read_with_crc32,
)
from hsextract.storage.s3_errors import (
    VerificationFailed,
    checksum_refused,
    describe_transient,
    explain_refusal,
    explain_rejection,
    find_cause,
    is_transient,
    never_connected,
    no_answer,
    unanswered,
    unreachable,
)

log = logging.getLogger(__name__)


T = TypeVar("T")


FIRST_CONTACT_S = 30.0

"""A command that reads an output gives up on an endpoint that accepted a connection but never answered after
about this long (botocore's attempts x its read timeout): a socket that answers nothing is a wrong endpoint far more
often than an outage. Once the endpoint has answered, outages are waited out to the sink's deadline."""


WAIT_NOTICE_S = 3.0

"""A reading sink whose first request is unanswered this long says on its log what it waits for."""


READING_ATTEMPTS = 3

"""botocore's attempts at each request of a reading sink, the first included."""


def resolve_endpoint(endpoint_url: str | None) -> str | None:
    """The S3 endpoint to use: the argument, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``."""
    if endpoint_url:
        return endpoint_url
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Sink(Sink):
    """Objects in an S3 bucket (or an S3-compatible store) under an optional prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        *,
        retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 64 * MiB,
        max_concurrency: int = 16,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 120.0,
        botocore_max_attempts: int = 3,
        unreached_fails_fast: bool = False,
    ) -> None:
        """``max_concurrency`` bounds the requests in flight across all uploads of this sink together.

        ``botocore_max_attempts`` is botocore's own quick retrying; ``retry_deadline_s`` is how long this sink keeps
        retrying a transient failure on top of that. With ``unreached_fails_fast`` (the commands that read an
        output), a connection never made (refused, no route, no such host) before the endpoint first answered
        fails at once, naming the endpoint: that is a wrong endpoint far more often than an outage.
        """
        import boto3
        import botocore.session
        from boto3.s3.transfer import S3Transfer, TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.retry_deadline_s = retry_deadline_s
        self.unreached_fails_fast = unreached_fails_fast
        self._answered = False  # the endpoint has answered a request of this sink (an error response counts)
        self._wait_said = False
        retries = {"mode": "standard", "max_attempts": botocore_max_attempts}  # retries, after the first
        if unreached_fails_fast:  # the first contact is given up after ~FIRST_CONTACT_S (_retrying)
            retries = {"mode": "standard", "total_max_attempts": READING_ATTEMPTS}
            read_timeout_s = min(read_timeout_s, FIRST_CONTACT_S / READING_ATTEMPTS)
            connect_timeout_s = min(connect_timeout_s, FIRST_CONTACT_S / READING_ATTEMPTS)
        config = Config(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries=retries,
            max_pool_connections=max(10, 2 * max_concurrency),
            tcp_keepalive=True,
        )
        # A session per sink: boto3's default session is shared module state, not meant for several threads.
        # Timestamps stay the strings the server sent: nothing here reads one, and parsing them is most of the
        # CPU of a listing (~1 ms an object: seconds for an output's thousands of completion records).
        core = botocore.session.Session()
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
        session = boto3.session.Session(botocore_session=core)
        try:
            self._client = session.client("s3", endpoint_url=resolve_endpoint(endpoint_url), config=config)
        except Exception as e:  # credentials half set, a bad profile, a malformed endpoint: botocore's words
            refusal = explain_refusal(e, self)
            if refusal is None:
                raise HsextractError(f"cannot reach {self.url}: {type(e).__name__}: {e}") from None
            raise HsextractError(refusal) from None
        self.endpoint = redact(self._client.meta.endpoint_url)  # for messages: never a credential
        # One transfer manager for the sink: max_concurrency then bounds all uploads in flight together.
        self._transfer = S3Transfer(
            client=self._client,
            config=TransferConfig(
                multipart_threshold=multipart_threshold,
                multipart_chunksize=multipart_chunksize,
                max_concurrency=max_concurrency,
                use_threads=True,
                # Not the CRT client even where awscrt is installed: the arguments and errors used here are the
                # classic manager's.
                preferred_transfer_client="classic",
            ),
        )
        self._send_checksums = self._client.meta.config.request_checksum_calculation != "when_required"
        self.multipart_threshold = multipart_threshold

    def _object_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, local_path: Path, key: str, expected_crc32: int | None = None) -> StoredObject:
        local_path = Path(local_path)
        size = local_path.stat().st_size
        if size < self.multipart_threshold:
            return self._retrying(
                f"upload of {key}", lambda: self._put_small(local_path, key, expected_crc32)
            )
        if expected_crc32 is not None and self._send_checksums:
            crc = expected_crc32  # S3 checks the parts it receives against it
        else:
            _, crc = read_with_crc32(local_path)
            if expected_crc32 is not None and crc != expected_crc32:
                raise changed_file(local_path, crc, expected_crc32)
        extra_args = {}
        if self._send_checksums:
            extra_args = {
                "ChecksumAlgorithm": "CRC32",
                "ChecksumCRC32": crc32_base64(crc),
                "ChecksumType": "FULL_OBJECT",
            }

        def upload_and_verify() -> StoredObject:
            try:
                self._transfer.upload_file(
                    str(local_path), self.bucket, self._object_key(key), extra_args=extra_args
                )
                self._verify(key, size, crc)
            except Exception as e:
                if expected_crc32 is not None and checksum_refused(find_cause(e)):
                    _, now = read_with_crc32(local_path)
                    if now != expected_crc32:  # not damage in transit: the file is not what was written
                        self._client.delete_object(Bucket=self.bucket, Key=self._object_key(key))
                        raise changed_file(local_path, now, expected_crc32) from None
                raise
            return StoredObject(key, size, crc)

        return self._retrying(f"upload of {key}", upload_and_verify)

    def _put_small(self, local_path: Path, key: str, expected_crc32: int | None) -> StoredObject:
        """One read: the bytes checked are the bytes sent."""
        data = local_path.read_bytes()
        crc = zlib.crc32(data)
        if expected_crc32 is not None and crc != expected_crc32:
            raise changed_file(local_path, crc, expected_crc32)
        extra = {"ChecksumCRC32": crc32_base64(crc)} if self._send_checksums else {}
        self._client.put_object(Bucket=self.bucket, Key=self._object_key(key), Body=data, **extra)
        self._verify(key, len(data), crc)
        return StoredObject(key, len(data), crc)

    def _verify(self, key: str, size: int, crc: int) -> None:
        head = self._client.head_object(Bucket=self.bucket, Key=self._object_key(key), ChecksumMode="ENABLED")
        if head["ContentLength"] != size:
            raise VerificationFailed(
                f"{self.url}/{key} has {head['ContentLength']} bytes, the local file {size}"
            )
        remote = head.get("ChecksumCRC32")
        # A composite checksum ("...-N", a checksum of part checksums) cannot be compared with the file's CRC32.
        if self._send_checksums and remote and "-" not in remote and remote != crc32_base64(crc):
            raise VerificationFailed(
                f"{self.url}/{key} has CRC32 {remote}, the local file {crc32_base64(crc)}"
            )

    def put_bytes(self, key: str, data: bytes) -> None:
        extra = {"ChecksumCRC32": crc32_base64(zlib.crc32(data))} if self._send_checksums else {}
        self._retrying(
            f"write of {key}",
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=self._object_key(key), Body=data, **extra
            ),
        )

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        def put() -> bool:
            try:
                self._client.put_object(
                    Bucket=self.bucket, Key=self._object_key(key), Body=data, IfNoneMatch="*"
                )
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                    return False
                raise
            return True

        # A retry after a lost response may find the object this call itself wrote: that is reported as absent
        # then present, so callers read the object back and compare rather than trusting the flag alone.
        return self._retrying(f"conditional write of {key}", put)

    def stored(self, key: str) -> StoredObject | None:
        head = self._retrying(f"lookup of {key}", lambda: self._head(key, checksum=True))
        if head is None:
            return None
        remote = head.get("ChecksumCRC32")
        crc = None
        if remote and "-" not in remote:
            crc = int.from_bytes(base64.b64decode(remote), "big")
        return StoredObject(key, head["ContentLength"], crc)

    def get_bytes(self, key: str) -> bytes:
        return self._retrying(f"read of {key}", lambda: self._get(key).read())

    read_range = read_range_via_into

    def read_range_into(self, key: str, offset: int, buffer, on_part=None) -> int:
        size = memoryview(buffer).nbytes
        if not size:
            return 0

        # A retry reads the whole range again. urllib3 reads each part into a bytes object, then copies it over.
        def fetch() -> int:
            body = self._get(key, f"bytes={offset}-{offset + size - 1}")
            return fill(lambda part, _: body.readinto(part), buffer, MiB, on_part)

        return self._retrying(f"read of {key}", fetch)

    def _get(self, key: str, byte_range: str | None = None):
        from botocore.exceptions import ClientError

        kwargs = {"Range": byte_range} if byte_range else {}
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._object_key(key), **kwargs)["Body"]
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(f"{self.url}/{key}") from e
            if code == "InvalidRange":  # offset at or past the end, as a local read gives
                return _Empty()
            raise

    def size(self, key: str) -> int:
        head = self._retrying(f"size of {key}", lambda: self._head(key))
        if head is None:
            raise FileNotFoundError(f"{self.url}/{key}")
        return head["ContentLength"]

    def object_info(self, key: str) -> dict | None:
        """``{"size", "etag"}`` of an object, or None when it does not exist."""
        head = self._retrying(f"lookup of {key}", lambda: self._head(key))
        if head is None:
            return None
        return {"size": head["ContentLength"], "etag": head.get("ETag", "").strip('"')}

    def get_file(self, key: str, local_path: Path) -> None:
        """Download an object to ``local_path`` (a temporary name, then renamed: a file under its final name is
        complete)."""
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.with_name(f".{local_path.name}.part")
        self._retrying(
            f"download of {key}",
            lambda: self._transfer.download_file(self.bucket, self._object_key(key), str(tmp)),
        )
        os.replace(tmp, local_path)

    def exists(self, key: str) -> bool:
        return self._retrying(f"lookup of {key}", lambda: self._head(key)) is not None

    def _head(self, key: str, checksum: bool = False) -> dict | None:
        from botocore.exceptions import ClientError

        extra = {"ChecksumMode": "ENABLED"} if checksum else {}
        try:
            return self._client.head_object(Bucket=self.bucket, Key=self._object_key(key), **extra)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def missing_place(self) -> str | None:
        from botocore.exceptions import ClientError

        def bucket_missing() -> bool:
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchBucket", "404"):
                    return True
                raise
            return False

        if self._retrying(f"lookup of bucket {self.bucket}", bucket_missing):
            return (
                f"bucket '{self.bucket}' does not exist at {self.endpoint}: check the URL {self.url} "
                "(and --s3-endpoint-url for an S3-compatible store)"
            )
        if not self.prefix:
            return None

        def anything_under_prefix() -> bool:
            page = self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + "/", MaxKeys=1)
            return bool(page.get("KeyCount") or page.get("Contents"))

        if self._retrying(f"listing of {self.url}", anything_under_prefix):
            return None
        return f"nothing is stored under {self.url}: the prefix '{self.prefix}' does not exist in bucket '{self.bucket}'"

    def list_keys(self, prefix: str = "") -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""

        def list_all() -> list[str]:
            paginator = self._client.get_paginator("list_objects_v2")
            keys = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                for item in page.get("Contents", []):
                    key = item["Key"][len(base) :]
                    if not key.startswith(PROBE_PREFIX):
                        keys.append(key)
            return keys

        return sorted(self._retrying(f"listing of {self.url}/{prefix}", list_all))

    def delete(self, key: str) -> None:
        self._retrying(
            f"delete of {key}",
            lambda: self._client.delete_object(Bucket=self.bucket, Key=self._object_key(key)),
        )

    def discard_partials(self, prefix: str) -> int:
        """Abort multipart uploads a killed uploader left open (their parts are billed until aborted)."""

        def abort_all() -> int:
            paginator = self._client.get_paginator("list_multipart_uploads")
            aborted = 0
            base = f"{self.prefix}/" if self.prefix else ""  # as list_keys: "" is the whole sink
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                for upload in page.get("Uploads", []):
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
            return aborted

        return self._retrying(f"clean-up of unfinished uploads under {self.url}/{prefix}", abort_all)

    def _retrying(self, what: str, operation: Callable[[], T]) -> T:
        """Run ``operation``, retrying transient failures with backoff until ``retry_deadline_s`` has passed."""
        notice = self._wait_notice(what)
        try:
            return self._retry_loop(what, operation)
        finally:
            if notice is not None:
                notice.cancel()

    def _retry_loop(self, what: str, operation: Callable[[], T]) -> T:
        start = time.monotonic()
        failures = 0
        while True:
            try:
                result = operation()
                self._answered = True
                return result
            except Exception as exc:
                cause = find_cause(exc)
                if answered(cause):
                    self._answered = True
                elif self.unreached_fails_fast and not self._answered:
                    if never_connected(cause):
                        raise HsextractError(unreachable(cause, self)) from exc
                    if no_answer(cause) or time.monotonic() - start > FIRST_CONTACT_S:
                        waited = time.monotonic() - start
                        raise HsextractError(unanswered(cause, self, what, waited)) from exc
                refusal = explain_refusal(cause, self)
                if refusal is not None:
                    raise HsextractError(refusal) from exc
                if not is_transient(cause):
                    rejection = explain_rejection(cause, what, self)
                    if rejection is not None:
                        raise HsextractError(rejection) from exc
                    raise
                failures += 1
                backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (failures - 1))
                pause = backoff / 2 + random.uniform(0, backoff / 2)
                elapsed = time.monotonic() - start
                if elapsed + pause > self.retry_deadline_s:
                    raise HsextractError(
                        f"gave up on the {what} in {self.url} after {failures} attempts in {elapsed:.0f} s: "
                        f"{describe_transient(cause, self)}"
                    ) from exc
                log.warning(
                    "retry %d of the %s in %.1f s: %s",
                    failures,
                    what,
                    pause,
                    describe_transient(cause, self),
                )
                time.sleep(pause)

    def _wait_notice(self, what: str) -> threading.Timer | None:
        """For a reading sink's first contact: a line on its log, once, if no answer came in ``WAIT_NOTICE_S``."""
        if not self.unreached_fails_fast or self._answered or self._wait_said:
            return None

        def say() -> None:
            if not self._answered and not self._wait_said:
                self._wait_said = True
                log.warning(
                    "waiting for the S3 endpoint %s to answer the %s in %s (giving up after ~%.0f s without "
                    "an answer)",
                    self.endpoint,
                    what,
                    self.url,
                    FIRST_CONTACT_S,
                )

        timer = threading.Timer(WAIT_NOTICE_S, say)
        timer.daemon = True
        timer.start()
        return timer


def answered(exc: BaseException) -> bool:
    """The server sent a response (an error response is one): the endpoint is the right place to wait for."""
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError)


class _Empty:
    def read(self) -> bytes:
        return b""

    def readinto(self, buffer) -> int:
        return 0
