"""One ``hsextract regenerate`` process owns an output at a time, as one ``run`` owns its shards.

Two processes on one output would request the same rows, write them twice and discard each other's chunk writes in
flight. The owner holds a lock for its life, in this user's cache on this host, keyed by the output (its absolute
path, or its URL): the kernel drops it with the process, so a killed run leaves nothing to clear. Processes on two
hosts writing one output are not seen from here.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.storage.fileio import cache_home, hold_lock


def output_identity(output: str) -> str:
    return output.rstrip("/") if "://" in output else str(Path(output).expanduser().resolve())


def lock_path(output: str) -> Path:
    """The output's lock file: under the user's cache, else (unwritable) this user's directory in the temp dir."""
    name = hashlib.sha256(output_identity(output).encode()).hexdigest()[:24] + ".lock"
    for root in (
        cache_home() / "regenerate" / "owners",
        Path(tempfile.gettempdir()) / f"hsextract-{os.getuid()}",
    ):
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK):
            return root / name
    raise HsextractError(
        f"neither {cache_home()} nor {tempfile.gettempdir()} can be written: regenerate keeps the lock that makes "
        "it the one process writing --output there; set XDG_CACHE_HOME to a writable directory"
    )


def own_output(output: str):
    """The open file holding ``output``'s lock (keep it open for the run's life); refused in one line naming the
    process that holds it."""
    held = hold_lock(lock_path(output))
    if isinstance(held, str):
        raise HsextractError(
            f"--output {output} is being written by another hsextract regenerate ({held}): two would request "
            "and write the same rows. Wait for it to finish, or stop it and rerun the same command to resume"
        )
    return held
