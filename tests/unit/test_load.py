"""Loading the target: the reader-thread knob of the CUDA path keeps every byte, and a bad value fails early."""

import pytest
import torch
from safetensors.torch import load_file

from hsextract.errors import HsextractError
from hsextract.model.load import LOAD_THREADS_ENV, load_model, load_threads, reader_threads


def test_load_threads_from_the_environment():
    assert load_threads(env={}) is None
    assert load_threads(env={LOAD_THREADS_ENV: " 16 "}) == 16
    for bad in ("0", "-2", "many", "1.5"):
        with pytest.raises(HsextractError, match=f"{LOAD_THREADS_ENV}=.*positive number of threads"):
            load_threads(env={LOAD_THREADS_ENV: bad})


def test_more_reader_threads_load_the_same_bytes_and_the_count_is_restored(tiny_model):
    from transformers import AutoModelForCausalLM, core_model_loading

    before = core_model_loading.GLOBAL_WORKERS
    with reader_threads(8):
        assert core_model_loading.GLOBAL_WORKERS == 8
        lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    assert core_model_loading.GLOBAL_WORKERS == before
    with reader_threads(None):
        assert core_model_loading.GLOBAL_WORKERS == before
    stored = load_file(str(tiny_model / "model.safetensors"))  # the file itself, not transformers' reader
    state = lm.state_dict()
    assert set(stored) <= set(state)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor.to(state[name].dtype)), name


def test_cpu_load_leaves_the_reader_as_it_is(tiny_model, monkeypatch):
    from transformers import core_model_loading

    seen = []
    monkeypatch.setenv(LOAD_THREADS_ENV, "7")
    original = core_model_loading.ThreadPoolExecutor

    def spy(*args, **kwargs):
        seen.append(kwargs.get("max_workers"))
        return original(*args, **kwargs)

    monkeypatch.setattr(core_model_loading, "ThreadPoolExecutor", spy)
    load_model(str(tiny_model), dtype="float32", device="cpu")
    assert seen and 7 not in seen
