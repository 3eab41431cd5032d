"""Processes as /proc shows them: alive, stopped, their descendants."""

import os
import signal
import time
from pathlib import Path


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc, None once the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, not yet reaped by its parent) counts as dead."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in "ZXx"


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))):
            children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def wait_dead(pids, timeout: float = 15) -> list[int]:
    """The pids still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it has stopped: from then on it changes nothing on disk."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while (stat := proc_stat(pid)) is not None and stat[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)
