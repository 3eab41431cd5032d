"""Process plumbing shared by the launcher, the workers and the uploaders: children that die with their parent,
per-process log files that never hold a credential, and stop signals turned into an exception.

A worker killed with SIGKILL cannot clean up, so its children ask Linux for a signal when it dies
(``PR_SET_PDEATHSIG``): an orphaned uploader would race the rerun's. SIGTERM and SIGINT raise ``Terminated`` in the
main thread, so that a process stops its children and says how it ended instead of vanishing without a word.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from hsextract.errors import redact

_PR_SET_PDEATHSIG = 1


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` as the interpreter would, less its teardown of every module: a process that imported
    torch and transformers spends a noticeable share of its CPU on that alone. The exit handlers still run (logging's flush, weakref
    finalizers, multiprocessing's children), and standard streams are flushed; with a non-daemon thread still
    running, this exits the usual way, which waits for it."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def steady_echo(follow: str):
    """``click.echo`` for a command that runs for hours: when its standard output fails (``run ... | head -1``,
    a redirect to a full disk) the command carries on, says once on stderr how to ``follow`` it, and writes
    nothing more there (was: exit 1 without a word, before any worker started)."""
    import click

    gone = False

    def echo(message=None, **kwargs):
        nonlocal gone
        if gone and not kwargs.get("err"):
            return
        try:
            click.echo(message, **kwargs)
        except OSError as e:
            if kwargs.get("err"):
                raise
            gone = True
            devnull = os.open(
                os.devnull, os.O_WRONLY
            )  # what is still buffered, and every later write, go there
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            click.echo(
                f"hsextract: standard output failed ({e.strerror or e}); carrying on: {follow}", err=True
            )

    return echo


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies. Call it in the child (``preexec_fn`` or first
    thing in a spawned process). With ``parent_pid``, also exit at once if the parent died before the request was
    made: the signal only covers deaths after it."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        print(f"hsextract: prctl(PR_SET_PDEATHSIG) failed, errno {ctypes.get_errno()}", file=sys.stderr)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))  # messages and tracebacks alike


def log_to_file(path: Path, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    """Send this process's logging to ``path`` (appending), URLs' credentials redacted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(_RedactingFormatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


class Terminated(BaseException):
    """A stop signal arrived. A BaseException, like KeyboardInterrupt: ``except Exception`` must not swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {self.signal_name}")

    def __reduce__(self):
        return type(self), (self.signum,)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by this signal."""
        return 128 + self.signum


class Stopped(Exception):
    """A shard's threads were told to stop (its ``stop`` event: a stop signal, or a failure its monitor met)."""


def stop_on_signals(signals=(signal.SIGTERM, signal.SIGINT), on_stop=None, deferred=None) -> None:
    """Make each of ``signals`` raise ``Terminated`` in the main thread; only the first one: later ones (Ctrl-C
    twice, a SIGTERM forwarded after a SIGINT to the whole group) are ignored while the process stops.
    ``on_stop(signum)`` runs first, e.g. to tell other threads to stop waiting. While ``deferred()`` is true the
    handler raises nothing: the main thread is in code that shares locks and queues with other threads, where an
    exception at an arbitrary bytecode can leave a lock held (a ``with`` entered but not yet guarded), and stops
    at its next check of what ``on_stop`` set instead. Call it from the main thread."""
    fired: list[int] = []

    def handler(signum, frame):
        if fired:
            return
        fired.append(signum)
        if on_stop is not None:
            on_stop(signum)
        if deferred is None or not deferred():
            raise Terminated(signum)

    for sig in signals:
        signal.signal(sig, handler)


def proc_state(pid: int) -> str | None:
    """The state letter of a process on this host (R, S, D, T, Z...) from /proc; None if unknown or gone."""
    if pid <= 0 or not sys.platform.startswith("linux"):
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]  # the state field follows the parenthesized name


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host. A zombie does not: a worker killed with its launcher stays one
    until init reaps it, which some container inits do late or never."""
    if pid <= 0:
        return False
    if sys.platform.startswith("linux"):
        state = proc_state(pid)
        return state is not None and state not in "ZXx"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_or_kill(procs, timeout: float) -> list:
    """Wait for every process in ``procs`` until ``timeout`` seconds from now have passed; those still running
    then are killed (and reaped), and returned."""
    deadline = time.monotonic() + timeout
    killed = []
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed.append(p)
    return killed
