"""Where batch files go: a local directory or S3, behind one interface (storage.base), chosen by the URL's scheme.

This package never imports torch: it runs in the light uploader process (a test says so)."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import uuid
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.storage.base import DEFAULT_RETRY_DEADLINE_S, PROBE_CONTENT, PROBE_PREFIX, Sink
from hsextract.storage.local import LocalSink


def _parse_output(output: str) -> tuple[str, str] | Path:
    """``(bucket, prefix)`` for an ``s3://`` URL, else the local directory."""
    scheme, sep, rest = output.partition("://")
    if not sep:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", output):
            raise HsextractError(
                f"the output '{output}' looks like a URL with a missing slash: write "
                f"{output.split(':', 1)[0]}://BUCKET/prefix (or ./{output} for a local directory)"
            )
        return Path(output)
    if scheme.lower() == "s3":
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise HsextractError(
                f"the output URL '{output}' names no bucket: write s3://BUCKET/optional/prefix"
            )
        return bucket, prefix
    if scheme.lower() == "file":
        return Path(rest)
    raise HsextractError(
        f"the output '{output}' has an unsupported scheme '{scheme}://': use s3://... or a local path"
    )


def open_sink(
    output: str,
    endpoint_url: str | None = None,
    *,
    retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
    reading: bool = False,
) -> Sink:
    """The sink for an output string: ``s3://bucket/optional/prefix`` gives an S3Sink, a path a LocalSink.

    ``reading``: a command that reads an output; an S3 endpoint it never reached fails at once (``S3Sink``)."""
    where = _parse_output(output)
    if isinstance(where, Path):
        return LocalSink(where)
    from hsextract.storage.s3 import S3Sink  # boto3 costs ~1 s to import; local runs never pay it

    return S3Sink(*where, endpoint_url, retry_deadline_s=retry_deadline_s, unreached_fails_fast=reading)


@contextlib.contextmanager
def log_on_stderr():
    """The storage's log lines (a reading sink's first contact unanswered for a few seconds, each retry) on stderr
    while the block runs: for the CLI's commands that read an output."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("hsextract.storage")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def preflight(output: str, endpoint_url: str | None = None) -> None:
    """Check within seconds that ``output`` can be written: write, read back and delete a probe object.

    Raises ``HsextractError`` saying what is wrong: a missing bucket, refused or missing credentials, denied
    access, an unreachable endpoint, or an unwritable directory.
    """
    where = _parse_output(output)
    sink: Sink
    if isinstance(where, Path):
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HsextractError(f"cannot create the output directory {where}: {e}") from e
        sink = LocalSink(where)
    else:
        from hsextract.storage.s3 import S3Sink

        # Short timeouts and a short retry budget: a preflight must fail in seconds, not after 30 minutes.
        sink = S3Sink(
            *where,
            endpoint_url,
            retry_deadline_s=5.0,
            connect_timeout_s=3.0,
            read_timeout_s=5.0,
            botocore_max_attempts=1,
        )
    probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    sink.put_bytes(probe, PROBE_CONTENT)
    try:
        if sink.get_bytes(probe) != PROBE_CONTENT:
            raise HsextractError(
                f"a probe object written to {sink.url} read back different: check the endpoint"
            )
    finally:
        sink.delete(probe)
