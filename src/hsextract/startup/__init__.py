"""What makes start-up fast, in one room: nothing here changes what a run computes or writes, only how soon its
first batch comes (kernels compiled and tuned ahead, workers started early, host memory pinned ahead).

The launcher reaches it through ``begin`` (the kernel cache and the warm-up beside the load), the worker through
``ready`` (once its model is on the device) and the pipeline through ``host_buffer`` and ``pinned_ahead``; nothing here imports run/.
"""

from __future__ import annotations

from contextlib import contextmanager

from hsextract.startup.warmup import (
    KERNEL_CACHE_ENV,
    KernelCache,
    Warmup,
    WarmupSpec,
    check_writable,
    open_kernel_cache,
    ready_kernels,
    resolve_kernel_cache,
    wait_for_warmup,
    warmup_pending,
)
from hsextract.startup.warmup import install_tables as _install_tables

__all__ = [
    "KERNEL_CACHE_ENV",
    "KernelCache",
    "Warmup",
    "WarmupSpec",
    "check_writable",
    "host_buffer",
    "open_kernel_cache",
    "pinned_ahead",
    "ready",
    "resolve_kernel_cache",
]


def ready(device, on_wait=None) -> None:
    """Before a worker's (or a dry run's) first forward, its model on ``device``: on CUDA the kernels readied as the
    warm-up readies them, then, where the warm-up runs beside the load, its kernels and autotune choices waited for
    (``on_wait`` is told first: the worker shows it)."""
    if device.type != "cuda":
        return
    ready_kernels()
    if warmup_pending():
        if on_wait is not None:
            on_wait()
        wait_for_warmup()
        _install_tables()  # what the warm-up chose and recorded


def host_buffer(numel: int, dtype):
    """A pinned host buffer of exactly ``numel`` elements of ``dtype``: one pinned ahead (hostmem.py) where one is
    large enough, else a new one."""
    from hsextract.startup.hostmem import host_buffer as take

    return take(numel, dtype)


@contextmanager
def pinned_ahead():
    """Around the making of the pipeline's buffers: yields how many host buffers were pinned ahead and the seconds
    that took (waiting for the pinning), and lets go of those not taken at the end."""
    from hsextract.startup.hostmem import drop_reserved, reserved

    yield reserved()
    drop_reserved()
