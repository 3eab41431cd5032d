"""Durable local writes: temp name, fsync, rename, fsync of the directory. Every file hsextract writes goes through here."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from hsextract.errors import HsextractError

TMP_MARK = ".tmp-"

"""In the name of every temporary file hsextract writes; such files are never read and are safe to delete."""


HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"

"""This host in temporary names: a shared output's temporary files say which host's process writes them."""


STALE_TMP_S = 3600.0

"""Age after which a temporary file of another host's process counts as left by a write that ended (no write of
hsextract leaves a file it is writing untouched that long)."""


def tmp_path(path: Path) -> Path:
    """A temporary name beside ``path``, unique per host, process and thread: ``NAME.tmp-HOST-PID-TID``."""
    return path.with_name(f"{path.name}{TMP_MARK}{HOST}-{os.getpid()}-{threading.get_native_id()}")


def stale_tmp(path: Path, now: float | None = None) -> bool:
    """A temporary file whose writer has gone: a process of this host that no longer runs, or (another host's, or
    a name without its host) one untouched for ``STALE_TMP_S``. Such a file never becomes a complete one."""
    host, _, rest = path.name.partition(TMP_MARK)[2].rpartition("-")[0].rpartition("-")
    if host == HOST and rest.isdigit():
        try:
            os.kill(int(rest), 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, another user's
            return False
        return False
    try:
        return (time.time() if now is None else now) - path.stat().st_mtime > STALE_TMP_S
    except FileNotFoundError:
        return False


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (e.g. certain network mounts) do not support fsync on directories
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str],
    content: bytes | str | Callable[[BinaryIO], Any],
    *,
    durable: bool = True,
) -> Any:
    """Write ``content`` (bytes, text, or a function that writes to the open file and returns a value) to ``path``.

    Temporary name, flush, fsync, rename, fsync of the directory: a file under its final name is complete. With
    ``durable=False`` (files rewritten every second that only report, never decide) the two fsyncs are skipped;
    the rename still makes every reader see a whole file. Returns what the writing function returned.
    """
    path = Path(path)
    check_not_dir(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                result = content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
                result = None
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        # Named by the file meant, not its temporary name; a write that fails as the file closes names none.
        if e.errno is not None and e.filename in (None, str(tmp)):
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return result


def check_not_dir(path: Path) -> None:
    """A directory where hsextract keeps a file is named, not met as ``IsADirectoryError`` (hsextract never
    removes what it did not write)."""
    if path.is_dir():
        raise HsextractError(
            f"{path} is a directory where hsextract keeps a file: move it away (nothing in it is hsextract's), "
            "then rerun the same command"
        )


def cache_home(env=None) -> Path:
    """hsextract's per-user cache: ``$XDG_CACHE_HOME/hsextract``, else ``~/.cache/hsextract``."""
    env = os.environ if env is None else env
    return Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache") / "hsextract"


def hold_lock(path: str | os.PathLike[str]):
    """An exclusive lock on ``path`` (made if absent), held by the returned open file for as long as it is open
    (the kernel drops it when the process dies), naming this process in the file; else who holds it ("pid N on
    H", as its holder wrote). How a process owns what one process at a time may write."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return holder
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}")
    f.flush()
    return f


def user_cache_dir(name: str, fallback: Path) -> Path:
    """``name`` in the user's cache, shared by every job on this machine (what is kept there is keyed by what it
    was made from), or ``fallback`` when that cannot be written."""
    shared = cache_home() / name
    try:
        shared.mkdir(parents=True, exist_ok=True)
        if os.access(shared, os.W_OK):
            return shared
    except OSError:
        pass
    return fallback


def write_json(path: str | os.PathLike[str], value: Any, *, durable: bool = True) -> None:
    atomic_write(path, json.dumps(value, indent=2), durable=durable)


def read_bytes(path: str | os.PathLike[str], what: str) -> bytes:
    """A file hsextract wrote, whole; a clear error naming it if it is missing or cannot be read."""
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise HsextractError(f"{path} ({what}) is missing: the run dir is incomplete") from None
    except OSError as e:
        raise _damaged(path, what, e) from None


def load_json(path: str | os.PathLike[str], what: str) -> Any:
    """A JSON file hsextract wrote; a clear error naming it if it is missing or damaged."""
    raw = read_bytes(path, what)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise _damaged(Path(path), what, e) from None


def _damaged(path: Path, what: str, e: Exception) -> HsextractError:
    return HsextractError(
        f"{path} ({what}) is damaged ({e}): rerun the same command with --restart to start this run over"
    )
