"""Finding and loading the target model: its config, its weights on a device, its decoder stack and final norm."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

from hsextract.errors import HsextractError, load_or_explain
from hsextract.model.fastload import fast_load_enabled
from hsextract.model.warmup import ready_kernels


def load_model_config(model: str):
    """The model's config (no weights), its text config and layer count; a clear error if the path is wrong."""
    from transformers import AutoConfig

    if os.path.sep in model or model.startswith(".") or Path(model).exists():
        if not Path(model).exists():
            raise HsextractError(f"--model {model}: no such directory")
        if Path(model).is_dir() and not (Path(model) / "config.json").exists():
            raise HsextractError(
                f"--model {model}: directory has no config.json (is it a transformers checkpoint?)"
            )
    config = load_or_explain(model, "read its config", lambda: AutoConfig.from_pretrained(model))
    text = config.get_text_config()
    num_layers = getattr(text, "num_hidden_layers", None)
    if not num_layers:
        raise HsextractError(f"--model {model}: config has no num_hidden_layers; is it a decoder LM?")
    return config, text, num_layers


LOAD_THREADS_ENV = "HSEXTRACT_LOAD_THREADS"

"""Threads transformers reads a checkpoint with onto a GPU (its ``core_model_loading.GLOBAL_WORKERS``, 4 by default,
chosen for disks). From the page cache more may read faster; the same bytes land either way.
``scripts/bench_startup.py --steps load`` times the load with 4 and 16."""


def load_threads(env=None) -> int | None:
    """``$HSEXTRACT_LOAD_THREADS`` as a positive int, or None (transformers' own count); a clear error if bad."""
    value = (os.environ if env is None else env).get(LOAD_THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise HsextractError(f"{LOAD_THREADS_ENV}={value!r}: give a positive number of threads, e.g. 16")
    return int(value)


@contextmanager
def reader_threads(n: int | None):
    """transformers' checkpoint reader with ``n`` threads for the duration (None: as it is)."""
    from transformers import core_model_loading

    old = getattr(core_model_loading, "GLOBAL_WORKERS", None)
    if n is None or old is None:
        yield
        return
    core_model_loading.GLOBAL_WORKERS = n
    try:
        yield
    finally:
        core_model_loading.GLOBAL_WORKERS = old


def load_model(
    model: str, *, dtype: str, device: str, attn_implementation: str = "sdpa", random_weights=False
):
    """The causal LM in eval mode on ``device``. For a multimodal checkpoint (e.g. Qwen3_5ForConditionalGeneration)
    transformers maps AutoModelForCausalLM to the text-only class and skips the vision tower's weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if random_weights:
        config = AutoConfig.from_pretrained(model).get_text_config()
        config._attn_implementation = attn_implementation
        with torch.device(device):
            lm = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        # device_map loads the weights straight onto the GPU, never staging 54 GB in host memory first.
        placement = {} if device == "cpu" else {"device_map": {"": device}}
        lm = None
        if device != "cpu" and fast_load_enabled():
            lm = fast_from_pretrained(
                model, dtype=torch_dtype, attn_implementation=attn_implementation, device=device
            )
        if lm is None:
            with reader_threads(None if device == "cpu" else load_threads()):
                lm = AutoModelForCausalLM.from_pretrained(
                    model, dtype=torch_dtype, attn_implementation=attn_implementation, **placement
                )
    lm.eval()
    lm.requires_grad_(False)
    return lm


def fast_from_pretrained(model: str, *, dtype, attn_implementation: str, device: str):
    """The model built by transformers from a state dict read by fastload.py (straight to ``device``); None when
    the checkpoint has no safetensors files or anything fails (the caller then loads it the usual way)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    from hsextract.model.fastload import checkpoint_files, no_allocator_warmup, read_state_dict

    files = checkpoint_files(model)
    if not files:
        return None
    state = None
    try:
        t0 = time.perf_counter()
        state = read_state_dict(files, device)
        t_read = time.perf_counter() - t0
        config = AutoConfig.from_pretrained(model)
        # The class AutoModelForCausalLM picks for this config; it takes a state dict only without a checkpoint path.
        model_class = _get_model_class(config, AutoModelForCausalLM._model_mapping)
        t_class = time.perf_counter() - t0 - t_read
        with no_allocator_warmup():
            lm = model_class.from_pretrained(
                None,
                config=config,
                state_dict=state,
                dtype=dtype,
                attn_implementation=attn_implementation,
                device_map={"": device},
            )
        size = sum(t.numel() * t.element_size() for t in state.values())
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


def load_model_for(cfg, device) -> object:
    """The model a run's config names, on ``device`` (a torch.device), with the run's kernels swapped in
    (qwen3_5.py): what the worker and dry-run load."""
    from hsextract.model import qwen3_5 as kernels

    if cfg.kernel_mode == "fused" and device.type == "cuda":
        kernels.check_shape(load_model_config(cfg.model)[1])  # before the weights
    lm = load_model(
        cfg.model,
        dtype=cfg.dtype,
        device=str(device),
        attn_implementation=cfg.attn_implementation,
        random_weights=cfg.random_weights,
    )
    swapped = kernels.apply(lm, cfg.kernel_mode)
    log.info("kernels: %s (%s)", cfg.kernel_mode, ", ".join(swapped) or "none swapped")
    if device.type == "cuda":
        ready_kernels()
    return lm


def torch_device(cfg):
    """``cuda:0`` (each worker sees only its own GPU) or ``cpu``."""
    import torch

    return torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")


def decoder_layers(lm):
    """The ModuleList of decoder layers, wherever the architecture keeps it."""
    import torch.nn as nn

    n = lm.config.get_text_config().num_hidden_layers
    candidates = [
        (name, mod)
        for name, mod in lm.named_modules()
        if isinstance(mod, nn.ModuleList)
        and len(mod) == n
        and name.split(".")[-1] in ("layers", "h", "blocks")
    ]
    if not candidates:
        raise HsextractError(f"could not find the {n} decoder layers of {type(lm).__name__}")
    return min(candidates, key=lambda c: c[0].count("."))[1]


def base_model(lm):
    """The decoder stack without the lm_head (its forward returns hidden states only)."""
    return lm.get_decoder() if hasattr(lm, "get_decoder") and lm.get_decoder() is not None else lm.base_model


def output_embeddings(lm):
    """The ``lm_head``: what turns the final normed state into logits."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        raise HsextractError(
            f"--target-topk: {type(lm).__name__} has no lm_head (output embeddings); load a causal LM"
        )
    return head


def final_norm(lm):
    """The norm the decoder applies after its last layer (what HF's last ``output_hidden_states`` entry has)."""
    decoder = base_model(lm)
    for name in ("norm", "final_layernorm", "ln_f"):
        if getattr(decoder, name, None) is not None:
            return getattr(decoder, name)
    raise HsextractError(
        f"could not find the final norm of {type(lm).__name__} (looked for norm, final_layernorm, ln_f)"
    )


log = logging.getLogger(__name__)
