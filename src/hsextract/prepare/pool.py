"""The tokenizer pool's start, safe from a Ctrl-C at any moment of it.

A terminal's Ctrl-C reaches the whole process group: a pool's process killed while it read its start-up data
printed an UnpicklingError, and a Ctrl-C that arrived as the pool's start ended left the run hanging with the pool
up. So the processes start with SIGINT ignored (they keep it for life: the parent stops them), the parent holds a
Ctrl-C (blocked) until they are started, and one that arrives as it is let through ends the pool first.
"""

from __future__ import annotations

import signal
import threading


def start_pool(context, num_proc: int, initializer, initargs: tuple):
    """``context.Pool(num_proc, initializer, initargs)`` whose processes ignore SIGINT; a Ctrl-C during its start
    is raised (by the caller's handler) once it is started, after the pool is ended."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return context.Pool(num_proc, initializer=initializer, initargs=initargs)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    pool = None
    try:
        pool = context.Pool(num_proc, initializer=initializer, initargs=initargs)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if handler is None else handler)
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a held Ctrl-C is raised here
        except BaseException:
            if pool is not None:
                pool.terminate()
                pool.join()
            raise
    return pool
