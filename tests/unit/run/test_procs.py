"""``exit_now``: the interpreter's exit without its teardown, in real processes (what it skips can only be seen
from outside)."""

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
