"""Errors a user can hit. The CLI prints their message (no traceback) and exits with status 2."""

import re

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it (``scheme://user:password@host``) replaced by ``***``."""
    return _USERINFO.sub(r"\1***@", text)


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


class UploaderDied(HsextractError):
    """The uploader process of a shard exited while batches were still to be uploaded."""


def load_or_explain(model: str, what: str, load):
    """``load()``; transformers failing to read ``model`` becomes a one-line user error saying ``what`` failed."""
    try:
        return load()
    except (OSError, ValueError) as e:
        raise HsextractError(f"--model {model}: could not {what} ({str(e).splitlines()[0]})") from None
