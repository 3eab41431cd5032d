"""Shared fixtures: the tiny random qwen3_5 model and tokenizer, built once per test session."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from hsextract.demo import build_model

    return build_model(tmp_path_factory.mktemp("tiny-qwen3_5"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_model):
    from hsextract.capture import load_model

    return load_model(str(tiny_model), dtype="float32", device="cpu")
