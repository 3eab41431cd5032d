"""A real S3 endpoint for tests: moto's S3 server on 127.0.0.1, in the test process.

``ThreadedMotoServer`` is a real HTTP server in a thread, so code under test, including the uploader's spawned
child process, reaches it over the network exactly as it would reach S3. Moto keeps its backend (buckets, objects,
IAM users) in module-level state of the process, so ``S3Endpoint.stop()`` followed by ``start()`` on the same port
is an outage that loses nothing: a stopped server closes its listening socket (connections are refused) and a
restarted one serves the same objects.

Moto does not check credentials unless told to: ``require_auth()`` turns its IAM checks on (moto's
``INITIAL_NO_AUTH_ACTION_COUNT`` setting, which is process-wide, so only within one test at a time) and
``create_credentials()`` makes an IAM user whose keys then pass.

Its fixtures come into a test module by import (ruff's F811 flags test parameters named after them)::

    # ruff: noqa: F811
    from s3server import aws_test_env, s3, s3_bucket  # noqa: F401
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterator

import pytest

# boto3 and moto are imported where a server starts: this plugin loads for every test, also on a GPU machine
# that has neither.

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REGION = "us-east-1"
# Variables that could point a test at a real account or endpoint; cleared by aws_test_env.
_AWS_VARIABLES = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Endpoint:
    """Moto's S3 server on 127.0.0.1 that can be stopped and restarted on the same port, keeping its objects."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.running = True

    def stop(self) -> None:
        """Stop serving: new connections are refused until ``start``. Objects are kept."""
        if self.running:
            self._server.stop()
            self.running = False

    def start(self) -> None:
        if not self.running:
            from moto.server import ThreadedMotoServer

            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            self._server.start()
            self.running = True

    def client(self, service: str = "s3", **credentials: str):
        """A boto3 client for this endpoint, with the fake credentials unless others are given."""
        credentials = credentials or {
            "aws_access_key_id": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        }
        import boto3

        return boto3.session.Session().client(
            service, endpoint_url=self.url, region_name=REGION, **credentials
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def object_keys(self, bucket: str) -> list[str]:
        paginator = self.client().get_paginator("list_objects_v2")
        return sorted(
            item["Key"] for page in paginator.paginate(Bucket=bucket) for item in page.get("Contents", [])
        )

    def get_object(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def create_credentials(self, *, allow_s3: bool = True) -> dict[str, str]:
        """An IAM user's access key as environment variables; with ``allow_s3`` its policy allows s3:*."""
        iam = self.client("iam")
        user = f"user-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=user)
        if allow_s3:
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    @contextlib.contextmanager
    def requests(self) -> Iterator[list[tuple[str, str]]]:
        """``(method, path)`` of every request the server answers within the block (any server of this process),
        from its request log: werkzeug's line per request, switched on for the block."""
        seen: list[tuple[str, str]] = []

        class Log(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                line = record.getMessage()
                if '"' in line:
                    method, _, rest = line.split('"')[1].partition(" ")
                    seen.append((method, rest.rsplit(" ", 1)[0].split("?")[0]))

        logger = logging.getLogger("werkzeug")
        handler, level, propagate = Log(), logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            yield seen
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate

    @contextlib.contextmanager
    def require_auth(self) -> Iterator[None]:
        """Within the block, every request must be signed with an IAM user's key (see ``create_credentials``)."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin

        previous = settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        ActionAuthenticatorMixin.request_count = 0
        try:
            yield
        finally:
            settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = previous


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Endpoint]:
    """One moto S3 endpoint for the test session; each test makes its own buckets."""
    endpoint = S3Endpoint()
    yield endpoint
    endpoint.stop()


@pytest.fixture
def s3_bucket(s3: S3Endpoint) -> Iterator[str]:
    """A fresh bucket on the session endpoint; the endpoint is running again after the test (outage tests)."""
    yield s3.create_bucket()
    s3.start()


@pytest.fixture
def aws_test_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Fake credentials and region in the environment (inherited by spawned processes), nothing from ~/.aws."""
    for name in _AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    missing = tmp_path_factory.mktemp("aws") / "missing"
    env = {
        **FAKE_CREDENTIALS,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": str(missing),
        "AWS_SHARED_CREDENTIALS_FILE": str(missing),
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups (slow off EC2)
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def cli_env(**overrides: str) -> dict[str, str]:
    """The environment of an ``hsextract`` subprocess: no AWS setting of this machine, fake credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    missing = "/nonexistent/hsextract-test-aws"
    env.update(
        FAKE_CREDENTIALS,
        AWS_DEFAULT_REGION=REGION,
        AWS_CONFIG_FILE=missing,
        AWS_SHARED_CREDENTIALS_FILE=missing,
        AWS_EC2_METADATA_DISABLED="true",
    )
    env.update(overrides)
    return env
