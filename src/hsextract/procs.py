"""Process plumbing shared by the launcher, the workers and the uploaders: children that die with their parent,
and per-process log files that never hold a credential.

A worker killed with SIGKILL (by a user, the OOM killer or a preempted node) cannot clean up, so its children must
not outlive it: an orphaned worker would keep its GPU busy, an orphaned uploader would race the rerun's uploader.
Linux delivers a chosen signal to a child when its parent dies (``PR_SET_PDEATHSIG``), once the child asks for it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from .errors import redact

_PR_SET_PDEATHSIG = 1


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
