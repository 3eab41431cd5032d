"""Finding and loading the target model: its config, its weights on a device, its decoder stack and final norm."""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

from hsextract.errors import HsextractError, load_or_explain
from hsextract.hub import resolve_model


def load_model_config(model: str, trust_remote_code: bool = False):
    """The model's config (no weights), its text config and layer count, from a checkpoint directory (a Hub id is
    resolved to one first: model/hub.py); a clear error if the directory is wrong."""
    from transformers import AutoConfig

    model = resolve_model(model).path
    stated = _stated_layers(Path(model) / "config.json")
    if stated is not None and (type(stated) is not int or stated < 1):
        raise HsextractError(f"--model {model}: {_not_a_layer_count(stated)}")

    def read():
        try:
            return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except Exception as e:  # a field of the wrong type (huggingface_hub's strict dataclasses): one line
            if type(e).__module__.startswith("huggingface_hub"):
                raise ValueError(" ".join(str(e).split())) from None
            raise

    config = load_or_explain(model, "read its config", read)
    text = config.get_text_config()
    num_layers = getattr(text, "num_hidden_layers", None)
    if num_layers is None:
        raise HsextractError(f"--model {model}: config has no num_hidden_layers; is it a decoder LM?")
    if type(num_layers) is not int or num_layers < 1:
        raise HsextractError(f"--model {model}: {_not_a_layer_count(num_layers)}")
    return config, text, num_layers


def _stated_layers(path: Path):
    """``num_hidden_layers`` as ``config.json`` states it (in its ``text_config`` when it has one); None when it
    does not (transformers may name it otherwise) or the file is not JSON (transformers says why)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    text = (
        raw.get("text_config") if isinstance(raw, dict) and isinstance(raw.get("text_config"), dict) else raw
    )
    return text.get("num_hidden_layers") if isinstance(text, dict) else None


def _not_a_layer_count(value) -> str:
    return (
        f"config.json's num_hidden_layers is {json.dumps(value)} ({type(value).__name__}), not a positive whole "
        "number of decoder layers: the config is damaged or edited; put back the checkpoint's own config.json"
    )


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
    model: str,
    *,
    dtype: str,
    device: str,
    attn_implementation: str = "sdpa",
    random_weights=False,
    trust_remote_code: bool = False,
    compute: str = "auto",
    fast_load=None,
):
    """The causal LM in eval mode on ``device``. For a multimodal checkpoint (e.g. Qwen3_5ForConditionalGeneration)
    transformers maps AutoModelForCausalLM to the text-only class and skips the vision tower's weights.
    ``compute``: its linears' numerics (fp8_load.py); ``lm.hsx_compute`` says what that resolved to. ``fast_load``:
    a faster way to the same weights on a GPU, tried first (``hsextract.startup.fast_load``; None from it, or none
    given: transformers' reader)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hsextract.model import fp8_load

    torch_dtype = getattr(torch, dtype)
    fp8_checkpoint = not random_weights and fp8_load.is_fp8_checkpoint(model)
    given = {"config": fp8_load.unquantized_config(model)} if fp8_checkpoint else {}
    if random_weights:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code).get_text_config()
        config._attn_implementation = attn_implementation
        with torch.device(device):
            lm = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        with fp8_load.scales_expected(fp8_checkpoint):
            lm = _from_pretrained(
                model, torch_dtype, attn_implementation, device, trust_remote_code, given, fast_load
            )
    lm.eval()
    lm.requires_grad_(False)
    lm.hsx_compute = fp8_load.apply_compute(
        lm,
        model=model,
        compute=compute,
        fp8_checkpoint=fp8_checkpoint,
        device=torch.device(device),
        dtype=torch_dtype,
    )
    return lm


def _from_pretrained(
    model: str, torch_dtype, attn_implementation: str, device: str, trust_remote_code, given, fast_load
):
    from transformers import AutoModelForCausalLM

    # device_map loads the weights straight onto the GPU, never staging 54 GB in host memory first.
    placement = {} if device == "cpu" else {"device_map": {"": device}}
    lm = None
    if fast_load is not None and device != "cpu" and not trust_remote_code:
        lm = fast_load(
            model, dtype=torch_dtype, attn_implementation=attn_implementation, device=device, **given
        )
    if lm is None:
        with reader_threads(None if device == "cpu" else load_threads()):
            lm = AutoModelForCausalLM.from_pretrained(
                model,
                dtype=torch_dtype,
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                **placement,
                **given,
            )
    return lm


def load_model_for(cfg, device, fast_load=None) -> object:
    """The model a run's config names, on ``device`` (a torch.device), with the run's kernels swapped in
    (qwen3_5.py): what the worker and dry-run load (``fast_load``: see ``load_model``)."""
    from hsextract.model import qwen3_5 as kernels

    if cfg.kernel_mode == "fused" and device.type == "cuda":
        kernels.check_shape(load_model_config(cfg.model_path, cfg.trust_remote_code)[1])  # before the weights
    lm = load_model(
        cfg.model_path,
        dtype=cfg.dtype,
        device=str(device),
        attn_implementation=cfg.attn_implementation,
        random_weights=cfg.random_weights,
        trust_remote_code=cfg.trust_remote_code,
        compute=cfg.compute,
        fast_load=fast_load,
    )
    swapped = kernels.apply(lm, cfg.kernel_mode)
    # "bf16" names the dense path: the weights' own dtype (float32 on a CPU run), which the line says
    compute = str(lm.dtype).removeprefix("torch.") if lm.hsx_compute == "bf16" else lm.hsx_compute
    log.info("kernels: %s (%s), compute %s", cfg.kernel_mode, ", ".join(swapped) or "none swapped", compute)
    if device.type != "cuda":
        quiet_cuda_kernel_advice()
    return lm


class _CudaKernelAdvice(logging.Filter):
    """transformers' advice to install flash-linear-attention and causal-conv1d for the Gated-DeltaNet layers: their
    kernels run on CUDA only, so on the CPU the reference path it falls back to is the only one there is."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


def quiet_cuda_kernel_advice() -> None:
    """Drop that advice in this process (a model on the CPU); on CUDA it is advice worth taking, and stays."""
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _CudaKernelAdvice) for f in logger.filters):
        logger.addFilter(_CudaKernelAdvice())


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
