"""Real, separately mounted small file systems, for the tests of a full disk."""

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(where: Path, size: str):
    """A tmpfs of ``size`` (``"4m"``) mounted at ``where`` for the block; needs root, as CI has: skips elsewhere."""
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
