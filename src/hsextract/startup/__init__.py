"""What makes start-up fast, in one room: nothing here changes what a run computes or writes, only how soon its
first batch comes (kernels compiled and tuned ahead, workers started early, weights read fast, memory pinned ahead).

The launcher calls ``begin`` (-> ``Startup``: kernel cache, early workers, warm-up, every worker process started one
way) and its preflight ``check``; a worker ``arrive``, ``fast_load`` and ``ready``; the pipeline ``host_buffer`` and
``pinned_ahead``. Nothing here imports run/.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from hsextract.startup.begin import Startup, begin
from hsextract.startup.early import arrive
from hsextract.startup.fastload import fast_load
from hsextract.startup.files import StartupFiles
from hsextract.startup.warmup import (
    KERNEL_CACHE_ENV,
    check_writable,
    ready_kernels,
    resolve_kernel_cache,
    wait_for_warmup,
    warmup_pending,
)
from hsextract.startup.warmup import install_tables as _install_tables

__all__ = [
    "Startup",
    "StartupFiles",
    "arrive",
    "begin",
    "check",
    "fast_load",
    "host_buffer",
    "pinned_ahead",
    "ready",
]


def check(cfg) -> None:
    """Before anything is written: on CUDA, a kernel cache the user chose (``--kernel-cache``,
    ``$HSEXTRACT_KERNEL_CACHE``) can be written (the default one falls back to the run dir's)."""
    if cfg.device == "cuda" and (cfg.kernel_cache or os.environ.get(KERNEL_CACHE_ENV)):
        check_writable(resolve_kernel_cache(cfg.kernel_cache, cfg.device))


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
