"""Errors a user can hit. The CLI prints their message (no traceback) and exits with status 2."""


class HsextractError(Exception):
    """A problem with the user's input or environment, worded as what was wrong and what to do."""


class UploaderDied(HsextractError):
    """The uploader process of a shard exited while batches were still to be uploaded."""
