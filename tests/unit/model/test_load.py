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


def test_fast_reader_gives_every_tensor_of_the_file_byte_for_byte(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from hsextract.startup.fastload import checkpoint_files, read_state_dict

    files = checkpoint_files(tiny_model)
    assert files == [tiny_model / "model.safetensors"]
    stored = load_file(str(files[0]))
    # Small pieces, so that most tensors straddle several reads and most reads several tensors.
    got = read_state_dict(files, "cpu", threads=3, chunk=4093)
    assert set(got) == set(stored)
    for name, tensor in stored.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # A checkpoint in several files with an index, as real ones are.
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    lm.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    sharded = checkpoint_files(tmp_path / "sharded")
    assert len(sharded) > 1 and all(p.name.endswith(".safetensors") for p in sharded)
    together = {}
    for p in sharded:
        together.update(load_file(str(p)))
    got = read_state_dict(sharded, "cpu", threads=4, chunk=1 << 16)
    assert set(got) == set(together) and all(torch.equal(got[k], v) for k, v in together.items())


def test_fast_load_builds_the_same_model_and_falls_back_on_a_bad_file(tiny_model, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM, modeling_utils

    from hsextract.startup import fast_load

    warmup = modeling_utils.caching_allocator_warmup
    fast = fast_load(str(tiny_model), dtype=torch.float32, attn_implementation="sdpa", device="cpu")
    assert modeling_utils.caching_allocator_warmup is warmup  # restored
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    a, b = fast.state_dict(), plain.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # cut short
    assert fast_load(str(broken), dtype=torch.float32, attn_implementation="sdpa", device="cpu") is None
