"""Shared fixtures: the tiny random qwen3_5 model and tokenizer, built once per test session."""

import logging
import os
import signal
import sys
import threading

import pytest
import torch
from support.cli import e2e_run_args, run_cli, write_mixed_dataset
from support.output import write_output

pytest_plugins = ["support.s3server"]

# One thread per torch, here and in every process the tests start (the launcher keeps a given OMP_NUM_THREADS): two
# test files run at once on two cores, and the tiny model's small ops wait on spinning threads otherwise (its
# in-process output: 1.2 CPU-s with one thread, 10.8 with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# The user's cache (model records, kernel cache) in a directory of this test process's own, for it and every
# process it starts: shared by its tests as by a user's jobs, never the home directory's.
if "HSEXTRACT_TEST_CACHE" not in os.environ:
    import tempfile

    os.environ["HSEXTRACT_TEST_CACHE"] = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(
        prefix="hsextract-cache-"
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from hsextract.demo import build_model

    return build_model(tmp_path_factory.mktemp("tiny-qwen3_5"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_model):
    from hsextract.model.load import load_model

    return load_model(str(tiny_model), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, tiny_model, tiny_tokenizer):
    """One finished ``hsextract run`` (2 shards, 16 batches of the mixed dataset) shared by every test that only
    reads it: (root, data, result, args), the output in ``root / "out"``. Copy the output before damaging it."""
    root = tmp_path_factory.mktemp("e2e")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer)
    args = e2e_run_args(root, tiny_model, data)
    result = run_cli(*args)
    return root, data, result, args


@pytest.fixture(scope="session")
def written_output(tmp_path_factory, tiny_model, tiny_tokenizer):
    """A finished output like ``finished_run``'s (its options and data; layers 0, 1, 3, so that the forward stops
    at layer 3), written in this process by the project's own steps (support/output.py): for unit tests that only
    read or damage an output. Copy it before damaging it."""
    root = tmp_path_factory.mktemp("written")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer)
    return write_output(root, tiny_model, data, layers="0,1,3")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture
def restored_process_state():
    """What ``run`` installs in the process that calls it (signal handlers, the log redaction, the excepthooks) is
    put back after the test: for tests that run the CLI in-process."""
    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    saved = logging.getLogRecordFactory(), sys.excepthook, threading.excepthook
    yield
    for s, handler in signals.items():
        signal.signal(s, handler)
    logging.setLogRecordFactory(saved[0])
    sys.excepthook, threading.excepthook = saved[1], saved[2]
