"""The tokenizer pool's start (hsextract/prepare/pool.py) keeps a Ctrl-C that arrives while it starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A fresh interpreter (no resource tracker yet, as in `hsextract run`) starts a pool of two while a Ctrl-C
# arrives at the moment named by argv[1]: the first process the start spawns (the resource tracker: its start
# unblocks SIGINT in the caller) or the second (a pool process). The pool's processes report their SIGINT.
SCRIPT = r"""
import multiprocessing, multiprocessing.util, os, signal, sys
from hsextract.prepare.pool import start_pool

def init(tag):
    assert tag == "ok"

def disposition(_):
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN

if __name__ == "__main__":
    at = int(sys.argv[1])
    spawn, calls = multiprocessing.util.spawnv_passfds, []

    def spawn_then_ctrl_c(*args):
        pid = spawn(*args)
        calls.append(pid)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGINT)
        return pid

    multiprocessing.util.spawnv_passfds = spawn_then_ctrl_c
    try:
        pool = start_pool(multiprocessing.get_context("spawn"), 2, init, ("ok",))
    except KeyboardInterrupt:
        print("interrupted", len(calls))
        sys.exit(130)
    print("started", pool.map(disposition, range(4)))
    pool.terminate()
"""


@pytest.mark.parametrize("at", [1, 2, 99], ids=["tracker", "pool-process", "none"])
def test_a_ctrl_c_while_the_pool_starts_is_raised_once_it_is_up_and_its_processes_ignore_it(at, tmp_path):
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(at)], capture_output=True, text=True, timeout=120)
    if at == 99:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "started [True, True, True, True]", done.stdout
    else:  # was: the Ctrl-C at the tracker's start dropped, the pool started and the run went on
        assert done.returncode == 130, done.stdout + done.stderr
        assert done.stdout.startswith("interrupted"), done.stdout
    assert "Traceback" not in done.stderr, done.stderr
