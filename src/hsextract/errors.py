"""Errors a user can hit. The CLI prints their message (no traceback) and exits with status 2."""


class HsextractError(Exception):
    """A problem with the user's input or environment, worded as what was wrong and what to do."""


class CorruptOutputError(HsextractError):
    """A file of an output is missing, damaged, or differs from what the manifest recorded of it.

    ``url`` is the output (a directory or ``s3://bucket/prefix``), ``key`` the file in it (a batch file or
    ``manifest.json``), ``problem`` what is wrong, in words.
    """

    def __init__(self, url: str, key: str, problem: str):
        self.url, self.key, self.problem = url, key, problem
        super().__init__(f"{url.rstrip('/')}/{key}: {problem}")


class UploaderDied(HsextractError):
    """The uploader process of a shard exited while batches were still to be uploaded."""


def load_or_explain(model: str, what: str, load):
    """``load()``; transformers failing to read ``model`` becomes a one-line user error saying ``what`` failed."""
    try:
        return load()
    except (OSError, ValueError) as e:
        raise HsextractError(f"--model {model}: could not {what} ({str(e).splitlines()[0]})") from None
