"""Pinned host buffers of exactly the size asked for, made fast, and made ahead by an early worker.

The pipeline's host buffers must be page-locked for the device-to-host copies to run beside the forward; torch's
caching host allocator rounds each up to a power of two and locks it in one thread. ``pinned_empty`` takes memory of
the exact size, faults it in with torch's threads, then registers it (``cudaHostRegister``); ``reserve`` does that
in the background of an early worker. A failed registration falls back to the caching allocator, with a warning."""

from __future__ import annotations

import logging
import threading
import time
import weakref

import torch

log = logging.getLogger(__name__)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # at interpreter exit the runtime may be gone; the memory goes with the process
        pass


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory as a uint8 tensor (CUDA must be available). The memory is
    unregistered when this tensor object is collected: keep it (not only views of it) while copies use it."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return buf
    buf.zero_()  # every page faulted in now, by torch's intra-op threads, so the registration only locks them
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
    if int(err) != 0:
        log.warning(
            "cudaHostRegister of %.2f GB failed (%s); using the caching pinned allocator", nbytes / 1e9, err
        )
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buf, _unregister, buf.data_ptr())
    return buf


class _Reserve:
    def __init__(self):
        self.lock = threading.Lock()
        self.buffers: list[torch.Tensor] = []
        self.thread: threading.Thread | None = None
        self.seconds: float | None = None

    def wait(self) -> None:
        thread = self.thread
        if thread is not None:
            thread.join()


_reserve = _Reserve()


def reserve(count: int, nbytes: int) -> None:
    """Start making ``count`` pinned buffers of ``nbytes`` in a background thread; ``host_buffer`` takes them."""

    def make():
        t0 = time.perf_counter()
        try:
            for _ in range(count):
                buf = pinned_empty(nbytes)
                with _reserve.lock:
                    _reserve.buffers.append(buf)
        except Exception as e:  # the pipeline makes its own buffers then
            log.warning("could not pin host buffers ahead: %r", e)
        _reserve.seconds = time.perf_counter() - t0

    _reserve.thread = threading.Thread(target=make, name="hsextract-pin", daemon=True)
    _reserve.thread.start()


def reserved() -> tuple[int, float | None]:
    """How many buffers were made ahead and not taken yet, and the seconds that took (waits for the making)."""
    _reserve.wait()
    with _reserve.lock:
        return len(_reserve.buffers), _reserve.seconds


def host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor of ``numel`` elements: a reserved buffer if one is large enough, else a new one."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    _reserve.wait()
    with _reserve.lock:
        fits = [b for b in _reserve.buffers if b.numel() >= nbytes]
        buf = min(fits, key=torch.Tensor.numel) if fits else None
        if buf is not None:
            _reserve.buffers.remove(buf)
    if buf is None:
        buf = pinned_empty(nbytes)
    out = buf[:nbytes].view(dtype)
    out._hsextract_pinned = buf  # the registration lasts as long as the tensor handed out (see pinned_empty)
    return out


def drop_reserved() -> None:
    """Give back what was reserved and not taken (a plan of smaller batches, fewer slots)."""
    _reserve.wait()
    with _reserve.lock:
        _reserve.buffers.clear()
