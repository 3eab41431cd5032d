"""Kernel warm-up: what makes a process's first batches run without compiling or autotuning FLA's kernels.

cache.py the per-user kernel cache and its stamps of what is warm (no torch); tables.py autotune choices recorded
per GPU model; fla_patch.py every reach into FLA's and Triton's internals; launch.py the launcher's side (the
cache a run uses, the warm-up process beside the load, the worker's wait); process.py the warm-up process itself.
Outside this package only hsextract.startup imports it.
"""

from hsextract.startup.warmup.cache import KERNEL_CACHE_ENV, KernelCache, WarmSet, check_writable
from hsextract.startup.warmup.cache import resolve as resolve_kernel_cache
from hsextract.startup.warmup.fla_patch import fla_available, pin_token_count_autotune
from hsextract.startup.warmup.launch import (
    WARMUP_FLAG_ENV,
    Warmup,
    WarmupSpec,
    open_kernel_cache,
    wait_for_warmup,
    warmup_pending,
)
from hsextract.startup.warmup.tables import install_here as install_tables

__all__ = [
    "KERNEL_CACHE_ENV",
    "WARMUP_FLAG_ENV",
    "KernelCache",
    "WarmSet",
    "Warmup",
    "WarmupSpec",
    "check_writable",
    "fla_available",
    "install_tables",
    "open_kernel_cache",
    "ready_kernels",
    "resolve_kernel_cache",
    "wait_for_warmup",
    "warmup_pending",
]


def ready_kernels() -> dict:
    """Before a CUDA process's first forward, as the warm-up does, so that both look up the same autotune results:
    the norm kernels' autotune keys without the token count, and the recorded autotune choices."""
    return {"pinned": pin_token_count_autotune(), "tuned": install_tables()}
