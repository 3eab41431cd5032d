"""The checkpoint read straight onto the GPU: large parallel reads into pinned buffers, then async copies.

transformers copies each tensor from the file's mmap into pageable memory, then to the GPU, in a few threads; here
each file is read in ``CHUNK`` pieces by ``THREADS`` threads into reused pinned buffers, and transformers builds the
model from that state dict, so the bytes that land are the file's either way. On CUDA by default (timed in
docs/PERFORMANCE.md); ``HSEXTRACT_FAST_LOAD=0``, or any failure, leaves the load to transformers' reader.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from hsextract.container import header_json, read_file_head, torch_dtype
from hsextract.errors import HsextractError

log = logging.getLogger(__name__)


FAST_LOAD_ENV = "HSEXTRACT_FAST_LOAD"


CHUNK = 64 << 20

"""Bytes per read: large enough to stream at page-cache speed, small enough to keep a pinned buffer per thread."""


THREADS = 8


def fast_load_enabled(env=None) -> bool:
    """Unless ``HSEXTRACT_FAST_LOAD=0``."""
    return (os.environ if env is None else env).get(FAST_LOAD_ENV, "1") != "0"


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's safetensors files (from its index when it has one); [] when it has none."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header (name -> dtype, shape, data_offsets) and where the data starts in the file."""
    head = read_file_head(path)
    header = header_json(head, lambda why: HsextractError(f"{path} {why}"))
    header.pop("__metadata__", None)
    return header, len(head)


def _read_exactly(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += got


def read_state_dict(files, device, *, threads: int = THREADS, chunk: int = CHUNK) -> dict:
    """Every tensor of ``files``, on ``device``, read in ``chunk``-byte pieces by ``threads`` threads."""
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    local = threading.local()
    state: dict = {}

    def buffers():
        if not hasattr(local, "host"):
            local.host = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
            local.stream = torch.cuda.Stream(device) if cuda else None
        return local.host, local.stream

    def job(fd: int, start: int, end: int, pieces) -> None:
        host, stream = buffers()
        _read_exactly(fd, memoryview(host.numpy())[: end - start], start)
        with torch.cuda.stream(stream) if cuda else _nothing():
            for target, lo, hi, at in pieces:  # file bytes [lo, hi) go to target's bytes from ``at``
                target[at : at + hi - lo].copy_(host[lo - start : hi - start], non_blocking=cuda)
        if cuda:
            stream.synchronize()  # the pinned buffer is read again by the next job

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for path in files:
            header, data_start = read_header(path)
            spans = []
            for name, meta in header.items():
                t = torch.empty(meta["shape"], dtype=torch_dtype(meta["dtype"]), device=device)
                state[name] = t
                b, e = meta["data_offsets"]
                if e > b:
                    spans.append((data_start + b, data_start + e, t.view(-1).view(torch.uint8)))
            spans.sort(key=lambda s: s[0])
            fd = os.open(path, os.O_RDONLY)
            try:
                futures, i = [], 0
                end_of_data = spans[-1][1] if spans else data_start
                for start in range(data_start, end_of_data, chunk):
                    end = min(start + chunk, end_of_data)
                    while i < len(spans) and spans[i][1] <= start:
                        i += 1
                    pieces, j = [], i
                    while j < len(spans) and spans[j][0] < end:
                        lo, hi = max(spans[j][0], start), min(spans[j][1], end)
                        pieces.append((spans[j][2], lo, hi, lo - spans[j][0]))
                        j += 1
                    futures.append(pool.submit(job, fd, start, end, pieces))
                for f in futures:
                    f.result()
            finally:
                os.close(fd)
    if cuda:
        torch.cuda.synchronize(device)
    return state


def widen_fp8(state: dict, dtype) -> None:
    """An FP8 checkpoint's e4m3 tensors cast to ``dtype`` in ``state``, one at a time (exact: every e4m3 value is a
    bf16 value). transformers casts each into a new tensor while the dict still holds the old: both sizes at once."""
    for name, t in state.items():
        if t.is_floating_point() and t.element_size() == 1 and t.dtype != dtype:
            state[name] = t.to(dtype)  # the old one goes with the loop's next step


@contextmanager
def _nothing():
    yield


@contextmanager
def no_allocator_warmup():
    """transformers reserves the model's size on the GPU before loading (``caching_allocator_warmup``); with the
    weights already there that would double the peak, so it is skipped for the duration."""
    from transformers import modeling_utils

    original = getattr(modeling_utils, "caching_allocator_warmup", None)
    if original is None:
        yield
        return
    modeling_utils.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling_utils.caching_allocator_warmup = original


def fast_load(model: str, *, dtype, attn_implementation: str, device: str, config=None):
    """The model built by transformers from a state dict read here (straight to ``device``), what model/load.py's
    ``load_model`` is handed as its ``fast_load``; None when ``HSEXTRACT_FAST_LOAD=0``, the checkpoint has no
    safetensors files, or anything fails (the caller then loads it the usual way)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    if not fast_load_enabled():
        return None
    files = checkpoint_files(model)
    if not files:
        return None
    state = None
    try:
        t0 = time.perf_counter()
        state = read_state_dict(files, device)
        t_read = time.perf_counter() - t0
        size = sum(t.numel() * t.element_size() for t in state.values())
        config = config if config is not None else AutoConfig.from_pretrained(model)
        # The class AutoModelForCausalLM picks for this config; it takes a state dict only without a checkpoint path.
        model_class = _get_model_class(config, AutoModelForCausalLM._model_mapping)
        t_class = time.perf_counter() - t0 - t_read
        widen_fp8(state, dtype)  # in "model built": where transformers' own cast of them was
        with no_allocator_warmup():
            lm = model_class.from_pretrained(
                None,
                config=config,
                state_dict=state,
                dtype=dtype,
                attn_implementation=attn_implementation,
                device_map={"": device},
            )
        log.info(
            "fast load: %.1f GB read in %.1f s, model class in %.1f s, model built in %.1f s",
            size / 1e9,
            t_read,
            t_class,
            time.perf_counter() - t0 - t_read - t_class,
        )
        return lm
    except Exception as e:  # any failure: transformers' own reader, as without the option
        log.warning("fast load failed (%r); loading with transformers' reader", e)
        state = None
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return None
