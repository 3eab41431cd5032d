"""How S3 failures are told apart and worded (s3.py retries what waiting can fix and refuses the rest).

Transient: connection refused or reset, an unreachable endpoint, timeouts, 5xx, throttling, a checksum or size
mismatch (retried with backoff). Refusals that waiting cannot fix (refused or missing credentials, access denied,
a missing bucket) and other 4xx rejections get one message each, worded for the user. ``sink`` arguments are the
``S3Sink`` concerned (its ``url``, ``endpoint`` and ``bucket`` name it). No torch: this runs in the uploader.
"""

from __future__ import annotations


class VerificationFailed(Exception):
    """The stored object does not match the local file (size or checksum); the upload is repeated."""


_CREDENTIAL_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidClientTokenId"}
)


_ACCESS_DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "403"})


_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "NoSuchUpload",  # a multipart upload aborted under us; upload_file starts a fresh one
        "BadDigest",  # bytes damaged in transit; the local file is intact
        "XAmzContentSHA256Mismatch",
        "IncompleteBody",
    }
)


def find_cause(exc: BaseException) -> BaseException:
    """The botocore error behind ``exc``: boto3's upload_file wraps ClientErrors in S3UploadFailedError."""
    from boto3.exceptions import S3UploadFailedError

    seen = set()
    while isinstance(exc, S3UploadFailedError) and id(exc) not in seen:
        seen.add(id(exc))
        inner = exc.__cause__ or exc.__context__
        if inner is None:
            break
        exc = inner
    return exc


def is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        HTTPClientError,
        IncompleteReadError,
        SSLError,
    )

    if isinstance(exc, VerificationFailed):
        return True
    if isinstance(exc, SSLError):
        return "CERTIFICATE_VERIFY_FAILED" not in str(exc)
    if isinstance(exc, (ConnectionError, HTTPClientError, IncompleteReadError)):
        return True
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return code in _TRANSIENT_CODES or status >= 500 or status == 429 or code in {"500", "503"}
    return False


def never_connected(exc: BaseException) -> bool:
    """No connection was made at all: refused, no route, no such host, or no answer to the connect."""
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError

    return isinstance(exc, (EndpointConnectionError, ConnectTimeoutError))


def no_answer(exc: BaseException) -> bool:
    """A connection was made but no answer came in the read timeout."""
    from botocore.exceptions import ReadTimeoutError

    return isinstance(exc, ReadTimeoutError)


def unanswered(exc: BaseException, sink, what: str, waited_s: float) -> str:
    """The message for an endpoint that never answered a reading command's first request."""
    return (
        f"the S3 endpoint {sink.endpoint} gave no answer to the {what} in {sink.url} within {waited_s:.0f} s "
        f"({type(exc).__name__}): is an S3 server listening there? check --s3-endpoint-url (or "
        "AWS_ENDPOINT_URL_S3)"
    )


def unreachable(exc: BaseException, sink) -> str:
    """The message for an endpoint that was never reached: most often the wrong one."""
    if "amazonaws.com" in sink.endpoint:
        advice = "for an S3-compatible store pass --s3-endpoint-url URL (or set AWS_ENDPOINT_URL_S3)"
    else:
        advice = "check --s3-endpoint-url (or AWS_ENDPOINT_URL_S3): is a server up at that host and port?"
    return f"could not connect to the S3 endpoint {sink.endpoint} for {sink.url} ({exc}): {advice}"


def checksum_refused(exc: BaseException) -> bool:
    """The store refused the bytes it received, or holds other bytes, for their checksum."""
    from botocore.exceptions import ClientError

    if isinstance(exc, VerificationFailed):
        return True
    codes = {"BadDigest", "XAmzContentChecksumMismatch", "InvalidDigest"}
    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in codes


def explain_refusal(exc: BaseException, sink) -> str | None:
    """The user-facing message for a failure that retrying cannot fix, or None if ``exc`` is not one."""
    from botocore.exceptions import (
        ClientError,
        CredentialRetrievalError,
        NoAuthTokenError,
        NoCredentialsError,
        PartialCredentialsError,
        ProfileNotFound,
        SSLError,
        SSOError,
        TokenRetrievalError,
    )

    if isinstance(exc, ProfileNotFound):
        return f"{exc}: check AWS_PROFILE and ~/.aws/config"
    if isinstance(
        exc,
        (
            NoCredentialsError,
            PartialCredentialsError,
            CredentialRetrievalError,
            TokenRetrievalError,
            SSOError,
            NoAuthTokenError,
        ),
    ):
        return (
            f"no usable AWS credentials to write {sink.url} ({exc}): set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where an instance/pod role provides them"
        )
    if isinstance(exc, SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return f"the TLS certificate of {sink.endpoint} was not trusted ({exc}): check the endpoint URL or AWS_CA_BUNDLE"
    if not isinstance(exc, ClientError):
        return None
    error = exc.response.get("Error", {})
    code = error.get("Code", "")
    if code == "NoSuchBucket":
        return f"bucket '{sink.bucket}' does not exist at {sink.endpoint}: create it, or fix the output URL {sink.url}"
    if code in _CREDENTIAL_CODES:
        return (
            f"credentials were refused by {sink.endpoint} ({code}: {error.get('Message', '')}): "
            "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        )
    if code in _ACCESS_DENIED_CODES:
        return (
            f"access to {sink.url} was denied by {sink.endpoint} ({code}): the credentials in use need "
            "s3:PutObject, s3:GetObject, s3:DeleteObject and s3:ListBucket on it"
        )
    if code == "InvalidBucketName":
        return f"'{sink.bucket}' is not a valid bucket name (from the output URL {sink.url})"
    return None


def explain_rejection(exc: BaseException, what: str, sink) -> str | None:
    """The message for any other request the server refused (a 4xx that retrying does not change)."""
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return None
    error = exc.response.get("Error", {})
    code = error.get("Code", "")
    message = f"{sink.endpoint} refused the {what} in {sink.url}: {code}: {error.get('Message', '')}"
    if code in {"InvalidArgument", "InvalidRequest", "NotImplemented", "XAmzContentChecksumMismatch"}:
        message += (
            ". If this S3-compatible store does not support checksums, set "
            "AWS_REQUEST_CHECKSUM_CALCULATION=when_required"
        )
    return message


def describe_transient(exc: BaseException, sink) -> str:
    from botocore.exceptions import ConnectionError

    if isinstance(exc, ConnectionError):
        return f"could not reach {sink.endpoint} ({exc})"
    return f"{type(exc).__name__}: {exc}"
