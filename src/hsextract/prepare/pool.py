"""The tokenizer pool's start, safe from a Ctrl-C at any moment of it.

A terminal's Ctrl-C reaches the whole process group: a pool's process killed while it read its start-up data
printed an UnpicklingError, and a Ctrl-C that arrived as the pool's start ended left the run hanging with the pool
up. So the parent blocks SIGINT while it starts the processes, which inherit the blocked signal (a spawned process
keeps its parent's signal mask) and ignore it for life once they run (the parent stops them); a Ctrl-C that
arrives meanwhile is held, and raised by the caller's handler once the pool is started and ended again.

Nothing here sets SIGINT to "ignored" in the parent: a signal that another thread takes (tqdm's monitor, a
native library's thread) while it is ignored is dropped, and the run went on after the Ctrl-C. The resource
tracker is started first, because its start unblocks SIGINT in the caller (``multiprocessing.resource_tracker``).
"""

from __future__ import annotations

import signal
import threading
from multiprocessing import resource_tracker


def start_pool(context, num_proc: int, initializer, initargs: tuple):
    """``context.Pool(num_proc, initializer, initargs)`` whose processes ignore SIGINT; a Ctrl-C during its start
    is raised (by the caller's handler) once it is started, after the pool is ended."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return context.Pool(num_proc, initializer=_ignoring_sigint, initargs=(initializer, initargs))
    resource_tracker.ensure_running()
    held: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pool = None
    try:
        pool = context.Pool(num_proc, initializer=_ignoring_sigint, initargs=(initializer, initargs))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a Ctrl-C held by the kernel is recorded here
        signal.signal(signal.SIGINT, signal.SIG_DFL if handler is None else handler)
    if held:
        pool.terminate()
        pool.join()
        signal.raise_signal(signal.SIGINT)  # the caller's handler, as if the Ctrl-C came now
    return pool


def _ignoring_sigint(initializer, initargs: tuple) -> None:
    """A pool process's start: SIGINT, blocked since its birth, ignored from now on (a held one is dropped)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    initializer(*initargs)
