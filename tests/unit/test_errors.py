"""Errors: every hsextract exception survives pickling (process pools send them back to the parent), the one
redaction covers log records and tracebacks of any process that installs it, and only the CLI's processes do:
importing the library leaves its host's logging and excepthook alone."""

import importlib
import inspect
import logging
import pickle
import pkgutil
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

import hsextract
from hsextract.errors import CorruptOutputError, HsextractError, redact


def hsextract_exceptions() -> list[type]:
    for info in pkgutil.walk_packages(hsextract.__path__, "hsextract."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # GPU-only modules (triton) on a machine without them
            continue
    seen, todo = set(), [BaseException]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return sorted((c for c in seen if c.__module__.startswith("hsextract")), key=lambda c: c.__qualname__)


def example_args(cls) -> list:
    values = {str: "s3://bucket/prefix", int: 15, "str": "s3://bucket/prefix", "int": 15}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [
        values.get(p.annotation, "shard-00000/batch-000001.safetensors")
        for p in params
        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    ]


def test_every_hsextract_exception_survives_pickling_with_its_message_and_fields():
    classes = hsextract_exceptions()
    assert CorruptOutputError in classes and HsextractError in classes and len(classes) >= 6
    for cls in classes:
        e = cls(*example_args(cls))
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and str(back) == str(e), cls
        assert vars(back) == vars(e), cls
    e = pickle.loads(pickle.dumps(CorruptOutputError("s3://b/p", "shard-00000/x.safetensors", "truncated")))
    assert (e.url, e.key, e.problem) == ("s3://b/p", "shard-00000/x.safetensors", "truncated")


PROBE = r"""
import logging, threading
from hsextract.errors import install_redaction
install_redaction()
log = logging.getLogger("probe")
log.warning("retry 1: %s", 'Could not connect to the endpoint URL: "http://user:SECRET@127.0.0.1:1/b"')
try:
    raise OSError("http://user:SECRET@host/x")
except OSError:
    log.exception("failed")
def fail():
    raise ValueError("https://a:SECRET@b")
t = threading.Thread(target=fail)
t.start()
t.join()
raise RuntimeError("endpoint http://user:SECRET@host refused")
"""


def test_log_records_and_tracebacks_of_any_process_are_redacted():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    text = r.stdout + r.stderr
    assert r.returncode == 1 and "RuntimeError: endpoint http://***@host refused" in text, text
    assert "ValueError: https://***@b" in text and "OSError: http://***@host/x" in text
    assert 'endpoint URL: "http://***@127.0.0.1:1/b"' in text
    assert "SECRET" not in text, text
    assert redact("s3://k:v@bucket/p and http://u@h") == "s3://***@bucket/p and http://***@h"


IMPORT_PROBE = r"""
import logging, sys, threading
before = (logging.getLogRecordFactory(), sys.excepthook, threading.excepthook)
import hsextract, hsextract.output.reader, hsextract.training, hsextract.errors
after = (logging.getLogRecordFactory(), sys.excepthook, threading.excepthook)
print([name for name, a, b in zip(("record factory", "excepthook", "threading.excepthook"), before, after) if a is not b])
"""


def test_importing_the_library_changes_no_global_of_its_host():
    # A fresh interpreter: this one imported hsextract long ago. A trainer's process imports these two.
    r = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"importing hsextract replaced {r.stdout.strip()}"


@pytest.fixture
def host_globals():
    """Put back what a CLI command installs in this (test) process."""
    saved = (logging.getLogRecordFactory(), sys.excepthook, threading.excepthook)
    yield
    logging.setLogRecordFactory(saved[0])
    sys.excepthook, threading.excepthook = saved[1], saved[2]


def test_every_cli_command_redacts_its_own_process(host_globals, tmp_path):
    from hsextract.cli import main

    CliRunner().invoke(main, ["status", str(tmp_path / "nothing-here")])
    assert getattr(logging.getLogRecordFactory(), "redacts", False)
    record = logging.getLogger("probe").makeRecord(
        "probe", logging.WARNING, "f", 1, "at %s", ("s3://k:v@b/p",), None
    )
    assert record.getMessage() == "at s3://***@b/p"
