"""``exit_now``: the interpreter's exit without its teardown, in real processes (what it skips can only be seen
from outside)."""

import signal
import subprocess
import sys

PROGRAM = """
import atexit, sys, threading, time
from pathlib import Path
from hsextract.run.procs import exit_now

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
if sys.argv[2] == "thread":
    def late():
        time.sleep(0.3)
        (out / "thread").write_text("finished")
    threading.Thread(target=late).start()
sys.stdout.write("unflushed")
exit_now(int(sys.argv[3]))
"""


def run(tmp_path, mode: str, code: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path), mode, str(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_exit_now_keeps_the_code_the_exit_handlers_and_the_buffered_output(tmp_path):
    r = run(tmp_path, "plain", 3)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "unflushed"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_exit_now_waits_for_a_running_non_daemon_thread_as_the_interpreter_would(tmp_path):
    r = run(tmp_path, "thread", 0)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_the_cli_entry_exits_with_clicks_codes():
    version = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and "hsextract" in version.stdout, version.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "nonsense"], capture_output=True, text=True
    )
    assert usage.returncode == 2 and "No such command" in usage.stderr, usage.stderr


def test_a_run_whose_stdout_reader_goes_carries_on_and_says_so_once(monkeypatch, capsys):
    """``hsextract run ... | head -1``: the pipe's reader is gone after the first line. The run's echo says once on
    stderr how to follow it and writes nothing more there (was: exit 1 without a word, before any worker)."""
    import io
    import os

    from hsextract.run.procs import steady_echo

    read, write = os.pipe()
    stream = io.TextIOWrapper(os.fdopen(write, "wb"), write_through=True)
    monkeypatch.setattr(sys, "stdout", stream)
    echo = steady_echo("hsextract status RUN")
    os.close(read)  # `head -1` has read its line and gone
    for line in ("data: 28 rows", "plan: 7 batches", "done"):
        echo(line)  # a real EPIPE the first time; nothing raised, nothing more tried
    monkeypatch.undo()
    stream.close()
    said = capsys.readouterr().err.splitlines()
    assert said == ["hsextract: standard output failed (Broken pipe); carrying on: hsextract status RUN"]


SIGNALS = """
import os, signal, sys, threading
from hsextract.run.procs import Terminated, stop_on_signals

defer = sys.argv[1] == "deferred"
seen = []
stop_on_signals(on_stop=seen.append, deferred=lambda: defer)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)  # a second signal while stopping is ignored, whatever the mode
    threading.Event().wait(0.2)
    print("carried on", seen)
except Terminated as e:
    print("raised", e, seen)
"""


def test_a_stop_signal_raises_at_once_unless_the_main_thread_stops_at_its_own_checks():
    def run(mode):
        return subprocess.run(
            [sys.executable, "-c", SIGNALS, mode], capture_output=True, text=True, timeout=60
        ).stdout.strip()

    assert run("now") == "raised stopped by SIGTERM [15]"
    # Deferred (a worker's pipeline): the stop is recorded for the main thread's next check, and nothing is raised
    # into code that may be holding a lock shared with other threads.
    assert run("deferred") == "carried on [15]"


def test_the_launchers_stop_kills_a_worker_that_ignores_it_and_names_its_shard(monkeypatch):
    from hsextract.run import launcher

    monkeypatch.setattr(launcher, "STOP_GRACE_S", 1.0)
    obeys = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ignores = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    ignores.stdout.readline()  # its handler is set
    assert launcher._stop_workers({0: obeys, 1: ignores}) == [1]
    assert obeys.returncode == -signal.SIGTERM and ignores.returncode == -signal.SIGKILL
