"""Which device the workers run on, checked with the other cheap checks, before any data is prepared.

A run on ``cuda`` is refused at once when there is no CUDA, too few GPUs, or a GPU already nearly full: a worker
would otherwise fail after preparation with an error from deep inside torch. The facts come from NVML and torch's
package version, without importing torch or starting CUDA in the launcher; without NVML, torch is asked.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from hsextract.errors import HsextractError

FULL_FRACTION = 0.9

"""A GPU with more than this fraction of its memory in use by other processes is refused as already full."""


@dataclass(frozen=True)
class Gpu:
    index: int
    """As CUDA numbers it in this process (``CUDA_VISIBLE_DEVICES`` applied): what ``--gpus`` names."""
    name: str = ""
    used_bytes: int = 0
    total_bytes: int = 0
    """0: not known (no NVML, or a device NVML cannot look up)."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability (9, 0) for Hopper; None: not known."""


@dataclass(frozen=True)
class Cuda:
    gpus: tuple[Gpu, ...]
    missing: str | None = None
    """Why CUDA cannot run here, in words; None when it can."""


def resolve_device(device: str) -> tuple[str, str]:
    """``(device, why)``: ``auto`` made ``cuda`` or ``cpu``, with the reason to print; others as given."""
    if device != "auto":
        return device, ""
    cuda = detect_cuda()
    if cuda.missing is None:
        return "cuda", f"--device auto: {len(cuda.gpus)} GPU(s) with CUDA"
    return "cpu", f"--device auto: {cuda.missing}; CPU runs suit small models only"


@functools.cache
def detect_cuda() -> Cuda:
    """What this machine offers CUDA, read once per process."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = ""
    if "+cpu" in torch_version:
        return Cuda((), f"torch {torch_version} is a CPU-only build")
    try:
        import pynvml
    except ImportError:
        return _cuda_from_torch()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return Cuda((), f"no NVIDIA driver answers ({e})")
    try:
        gpus = tuple(_nvml_gpu(pynvml, i, ref) for i, ref in enumerate(_visible(pynvml.nvmlDeviceGetCount())))
    finally:
        pynvml.nvmlShutdown()
    return Cuda(gpus, None if gpus else _no_gpu_visible())


def _visible(count: int) -> list[str]:
    """The devices CUDA shows this process, as NVML indices or UUIDs, in CUDA's order."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(count)]
    refs = []
    for ref in (r.strip() for r in given.split(",")):
        if not ref or ref == "-1" or (ref.isdigit() and int(ref) >= count):
            break  # CUDA stops at the first invalid entry
        refs.append(ref)
    return refs


def _nvml_gpu(pynvml, index: int, ref: str) -> Gpu:
    try:
        handle = (
            pynvml.nvmlDeviceGetHandleByIndex(int(ref))
            if ref.isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(ref)
        )
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    except pynvml.NVMLError:  # a MIG instance or a UUID NVML does not resolve: counted, memory unknown
        return Gpu(index)
    try:
        capability = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    except (pynvml.NVMLError, AttributeError, TypeError):
        capability = None
    return Gpu(index, name if isinstance(name, str) else name.decode(), memory.used, memory.total, capability)


def _cuda_from_torch() -> Cuda:
    import torch

    if not torch.cuda.is_available():
        return Cuda((), f"torch {torch.__version__} finds no CUDA GPU")
    return Cuda(tuple(Gpu(i) for i in range(torch.cuda.device_count())))


def _no_gpu_visible() -> str:
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"no GPU is visible (CUDA_VISIBLE_DEVICES={given!r})" if given is not None else "no GPU is present"


def check_gpus(shards: int, gpus: tuple[int, ...] | None, cuda: Cuda) -> None:
    """The GPUs the shards would use exist and are not already full; else a message that says what to pass."""
    if cuda.missing is not None:
        raise HsextractError(
            f"--device cuda, but {cuda.missing}: pass --device cpu (small models only), or run on a machine "
            "with an NVIDIA GPU and a CUDA build of torch"
        )
    wanted = gpus[:shards] if gpus else tuple(range(shards))
    count = len(cuda.gpus)
    if max(wanted) >= count:
        shown = f"{count} GPU(s) (0..{count - 1})"
        if gpus:
            raise HsextractError(
                f"--gpus {','.join(map(str, gpus))} names GPU {max(wanted)}, but this machine shows {shown}: "
                f"pass --gpus with indices below {count}"
            )
        raise HsextractError(
            f"--shards {shards} needs {shards} GPUs (one per shard), but this machine shows {shown}: "
            f"pass --shards {count} or fewer"
        )
    for i in wanted:
        gpu = cuda.gpus[i]
        if gpu.total_bytes and gpu.used_bytes > FULL_FRACTION * gpu.total_bytes:
            others = [
                g.index for g in cuda.gpus if g.total_bytes and g.used_bytes <= FULL_FRACTION * g.total_bytes
            ]
            hint = (
                f"pass --gpus naming free ones ({','.join(map(str, others))} look free)"
                if others
                else ("wait for it to be freed (nvidia-smi shows what holds it)")
            )
            raise HsextractError(
                f"GPU {i}{f' ({gpu.name})' if gpu.name else ''} already has {gpu.used_bytes / 2**30:.1f} of "
                f"{gpu.total_bytes / 2**30:.1f} GiB in use by other processes: {hint}"
            )


FP8_GEMM_CAPABILITY = (9, 0)
"""Block-scaled fp8 GEMMs (``torch._scaled_mm`` with 1x128 / 128x128 scales) need Hopper."""


def check_fp8_compute(shards: int, gpus: tuple[int, ...] | None, cuda: Cuda) -> None:
    """``--compute fp8`` on GPUs known to lack block-scaled fp8 GEMMs is refused now, not by a worker after
    preparation (``--compute auto`` dequantizes an FP8 checkpoint there instead)."""
    wanted = gpus[:shards] if gpus else tuple(range(shards))
    for i in wanted:
        gpu = cuda.gpus[i] if i < len(cuda.gpus) else None
        if gpu is not None and gpu.capability is not None and gpu.capability < FP8_GEMM_CAPABILITY:
            raise HsextractError(
                f"--compute fp8 needs block-scaled fp8 GEMMs (a Hopper GPU, compute capability 9.0); GPU {i}"
                f"{f' ({gpu.name})' if gpu.name else ''} has {gpu.capability[0]}.{gpu.capability[1]}. Leave "
                "--compute at auto (an FP8 checkpoint is then dequantized on load, saying so)"
            )


def check_device(cfg) -> None:
    """``check_gpus`` for a run on ``cuda`` (``cfg`` a RunConfig), and its ``--compute fp8``; nothing to check on
    ``cpu``."""
    if cfg.device == "cuda":
        check_gpus(cfg.shards, cfg.gpus, detect_cuda())
        if getattr(cfg, "compute", "auto") == "fp8":
            check_fp8_compute(cfg.shards, cfg.gpus, detect_cuda())
