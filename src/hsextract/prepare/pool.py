"""The tokenizer pool's start, safe from a Ctrl-C at any moment of it (a terminal's Ctrl-C reaches the whole group).

The parent blocks SIGINT while it starts the processes, which inherit the block and ignore SIGINT once they run (the
parent stops them); a Ctrl-C held meanwhile is raised once the pool is up and ended again. The parent never ignores
SIGINT: a thread that takes it while it is ignored drops it. The resource tracker starts first, because its start
unblocks SIGINT in the caller (``multiprocessing.resource_tracker``).
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
