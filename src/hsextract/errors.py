"""Errors a user can hit. The CLI prints their message (no traceback) and exits with status 2."""

import errno
import logging
import os
import re
import shutil
import sys
import threading
import traceback
from pathlib import Path

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


_SECRETS: list[str] = []

"""Values this process holds that no message may show (an API key), longest first (``hide``)."""


def hide(secret: str) -> None:
    """From now on ``redact`` replaces ``secret`` wherever it appears, whatever put it in the text (a server echoing
    a header, an option given the key instead of its variable's name)."""
    if secret and secret not in _SECRETS:
        _SECRETS.append(secret)
        _SECRETS.sort(key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it (``scheme://user:password@host``) and every value passed to
    ``hide`` replaced by ``***``."""
    for secret in _SECRETS:
        text = text.replace(secret, "***")
    return _USERINFO.sub(r"\1***@", text)


def install_redaction() -> None:
    """Redact every message this process logs or dies with, once, at the places they all pass: each log record as
    it is made (message, arguments and traceback, whatever handler prints it: a log file, the console, logging's
    last resort) and uncaught exceptions' tracebacks. Libraries' own texts are covered too (botocore puts the
    endpoint URL, credentials and all, into its exceptions). ``HsextractError`` redacts its message itself.
    The CLI's own processes call this first thing (the command, each worker, each uploader); importing hsextract
    does not: a library leaves its host's logging and excepthook alone."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "redacts", False):
        return

    def make_record(*args, **kwargs):
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it when the record is printed
            return record
        record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        return record

    make_record.redacts = True
    logging.setLogRecordFactory(make_record)

    def excepthook(kind, value, tb):
        sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))

    def thread_excepthook(args):
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread is not None else "a thread"
            sys.stderr.write(f"Exception in thread {name}:\n")
            excepthook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook


class HsextractError(Exception):
    """A problem with the user's input or environment, worded as what was wrong and what to do. The message never
    carries a credential: URLs in it are redacted."""

    def __init__(self, message: str = ""):
        super().__init__(redact(str(message)))


class CorruptOutputError(HsextractError):
    """A file of an output is missing, damaged, or differs from what the manifest recorded of it.

    ``url`` is the output (a directory or ``s3://bucket/prefix``), ``key`` the file in it (a batch file or
    ``manifest.json``), ``problem`` what is wrong, in words.
    """

    def __init__(self, url: str, key: str = "", problem: str = ""):
        self.url, self.key, self.problem = url, key, problem
        # One argument is a whole message: how a DataLoader worker's error is raised again in the main process.
        super().__init__(f"{url.rstrip('/')}/{key}: {problem}" if key else url)

    def __reduce__(self):  # pickled across process pools (export): rebuilt from its fields, not its message
        return type(self), (self.url, self.key, self.problem)


class StagedFileChanged(HsextractError):
    """A staged batch file whose bytes, as read to upload them, are not the ones its writer wrote (their CRC32
    differs from the writer's): it was altered while it waited. Nothing is recorded for it; its batch is recomputed."""


class UploaderDied(HsextractError):
    """The uploader process of a shard exited while batches were still to be uploaded."""


FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

"""What a write returns when its file system (or the user's quota on it) is full."""


def free_bytes(path) -> int | None:
    """Bytes free to this user on the file system of ``path`` (or of its nearest existing parent); None if none
    can be asked."""
    path = Path(path)
    for place in (path, *path.parents):
        try:
            return shutil.disk_usage(place).free
        except OSError:
            continue
    return None


def disk_full(e: BaseException, where=None) -> HsextractError | None:
    """The one-line error for a write that found its file system full (ENOSPC, EDQUOT): the file (the error's own,
    else ``where``), the system's words and the bytes still free there; None for any other exception."""
    if not isinstance(e, OSError) or e.errno not in FULL_ERRNOS:
        return None
    if e.filename is None and where is None and _echoing(e):
        return HsextractError(
            f"cannot write to standard output: {e.strerror or 'No space left on device'} (the file it is "
            "redirected to is on a full file system); redirect it elsewhere"
        )
    path = e.filename or where
    free = free_bytes(path) if path else None
    room = f"; {free:,} bytes free on its file system" if free is not None else ""
    return HsextractError(
        f"cannot write {path or 'a file'}: {e.strerror or 'No space left on device'}{room}. Free space there, "
        "then rerun the same command to resume"
    )


def _echoing(e: BaseException) -> bool:
    """Whether ``e`` was raised while the CLI printed (click's ``echo``): a write to a standard stream."""
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "echo" and f"click{os.sep}utils.py" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def load_or_explain(model: str, what: str, load, flag: str = "--model"):
    """``load()``; transformers failing to read ``model`` (given as ``flag``) becomes a one-line user error saying
    ``what`` failed."""
    try:
        return load()
    except (OSError, ValueError) as e:
        raise HsextractError(f"{flag} {model}: could not {what} ({str(e).splitlines()[0]})") from None
