"""The CLI in a subprocess, its runs, waiting on them, and the data they run on."""

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


os.environ.setdefault("HF_HUB_OFFLINE", "1")


TINY_LIMITS = {"max_length": 300, "max_tokens_per_batch": 600, "max_rows": 16}


"""Batch limits for the tiny model: samples up to 300 tokens, a few of them per batch, many batches per run."""


RUN_TIMEOUT_S = 180


POLL_S = 0.02


def run_cli(*args, timeout=300, env=None, check=True, cwd=None):
    """``hsextract ARGS`` in a real subprocess; returns the CompletedProcess."""
    full_env = dict(os.environ, **(env or {}))
    r = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )
    if check and r.returncode != 0:
        raise AssertionError(
            f"hsextract {' '.join(map(str, args))} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        )
    return r


def cli_run_args(root, model, data, **options) -> list:
    """``hsextract run`` on CPU in float32 with output, run dir and staging under ``root``. ``options`` add or
    override ``--name value`` (underscores become dashes); ``True`` gives a bare flag, ``None`` drops an option."""
    opts = {
        "model": model,
        "data": data,
        "output": root / "out",
        "run-dir": root / "run",
        "staging": root / "staging",
        "device": "cpu",
        "dtype": "float32",
    }
    opts.update({key.replace("_", "-"): value for key, value in options.items()})
    args = ["run"]
    for key, value in opts.items():
        if value is True:
            args.append(f"--{key}")
        elif value is not None:
            args += [f"--{key}", str(value)]
    return args


def rehomed_args(args, root: Path, **options) -> list[str]:
    """A run's command with its output, run dir and staging moved under ``root`` (``out``, ``run``, ``staging``):
    the same batches, byte for byte. ``options`` replace those or add others (``--name value``)."""
    args = [str(a) for a in args]
    moved = {"output": root / "out", "run-dir": root / "run", "staging": root / "staging"}
    moved.update({key.replace("_", "-"): value for key, value in options.items()})
    for i, arg in enumerate(args):
        if arg.startswith("--") and arg[2:] in moved and i + 1 < len(args):
            args[i + 1] = str(moved.pop(arg[2:]))
    for key, value in moved.items():
        args += [f"--{key}", str(value)]
    return args


def batch_bytes(out: Path) -> dict[str, bytes]:
    """Every batch file of a local output, by key."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.glob("shard-*/*.safetensors"))}


E2E_LAYERS = (0, 3, 7)


"""Layers of the shared finished run: first, middle (a full-attention layer), last of the 8-layer tiny model."""


def e2e_run_args(root, model, data, **options) -> list:
    """The shared finished run's command (2 shards, ``E2E_LAYERS``, the tiny limits) under ``root``; ``options``
    override. Tokenization runs in one process (a pool of 2 costs ~7 CPU-s more than it saves on 58 rows; the
    pool's own tests are in-process, tests/unit/prepare/test_data.py)."""
    defaults = {
        "layers": ",".join(map(str, E2E_LAYERS)),
        "shards": 2,
        **TINY_LIMITS,
        "num_proc": 1,
        "no_progress": True,
    }
    return cli_run_args(root, model, data, **{**defaults, **options})


def write_mixed_dataset(path, tokenizer, n_chat=40, seed=0):
    """Chat rows from the demo generator plus pre-tokenized rows from 1 token up, with explicit ids."""
    import json
    import random

    from hsextract.demo import make_conversations

    rng = random.Random(seed)
    rows = make_conversations(n_chat, seed=seed)
    vocab = len(tokenizer)
    for i, n in enumerate([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 300, 1, 7, 64, 65, 127]):
        rows.append(
            {
                "id": f"tok-{i}",
                "input_ids": [rng.randrange(1, vocab) for _ in range(n)],
                "loss_mask": [1] + [rng.randint(0, 1) for _ in range(n - 1)],
            }
        )
    rng.shuffle(rows)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


# -- a CLI started in the background and killed for real -------------------------------------------------------------
@contextmanager
def launched(args, root: Path, env=None, cwd=None):
    """``hsextract ARGS`` in the background, its output in ``root/launcher.out``; killed (its workers die with it)
    if it is still running when the block ends."""
    with open(root / "launcher.out", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsextract.cli", *map(str, args)],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def launcher_output(root: Path) -> str:
    return (root / "launcher.out").read_text()


def run_logs(run_dir: Path, lines: int = 15) -> str:
    """The last lines of every log of a run dir, for a failing assertion's message: a failure on a CI machine is
    then understood from its output alone."""
    from hsextract.run.rundir import RunDir

    parts = []
    for log in sorted(RunDir(run_dir).logs_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(parts)


def wait_for(condition, what: str, *, proc=None, root=None, timeout: float = RUN_TIMEOUT_S):
    """Poll ``condition`` until it is truthy; fail naming ``what`` if the run exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"the run exited ({proc.returncode}) before {what}:\n{launcher_output(root)}"
            )
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(POLL_S)
    return value


def frozen_while_computing(run_dir: Path, proc, root: Path) -> list[int]:
    """The run's shards' workers, each frozen as soon as it computes (one may finish its share before it is seen), so
    that batches are still to be staged once they are continued (the test's premise: asserted). Their pids."""
    from hsextract.output import Plan
    from hsextract.run.progress import ShardProgress, ShardState
    from hsextract.run.rundir import RunDir
    from support.procs import freeze

    computing = {ShardState.RUNNING, ShardState.WAITING_FOR_UPLOADER, ShardState.DRAINING}
    rd = RunDir(run_dir)
    wait_for(rd.plan_file.exists, "the plan", proc=proc, root=root)
    shards = {b.shard for b in Plan.load(rd.plan_file).batches}
    pids, left, seen = [], [], set()

    def next_one():
        for s in shards - seen:
            p = ShardProgress.load(run_dir, s)
            if p and (p.state == ShardState.DONE or p.state in computing):
                return s, p
        return None

    while seen != shards:
        s, p = wait_for(next_one, "a shard computing", proc=proc, root=root)
        seen.add(s)
        if p.state != ShardState.DONE:
            freeze(p.pid)
            pids.append(p.pid)
            written = rd.log_file(s).read_text().count(" written: ")
            left.append(p.batches_total - written)
    assert any(left), f"the shards had staged their whole share before they were frozen: {left}"
    return pids


def done_keys(run_dir: Path) -> set[str]:
    """The batches the run's output records done (its completion records); none before the run dir names an
    output. The output is local: the test process has no S3 credentials of its own."""
    from hsextract.config import RunConfig
    from hsextract.errors import HsextractError
    from hsextract.output.ledger import done_in_output
    from hsextract.storage.local import LocalSink

    try:
        output = RunConfig.load(Path(run_dir) / "config.json").output
    except (OSError, HsextractError):
        return set()
    return done_in_output(LocalSink(Path(output)))


def done_count(run_dir: Path, shard: int | None = None) -> int:
    from hsextract.output.ledger import shard_name

    keys = done_keys(run_dir)
    return len(keys) if shard is None else sum(k.startswith(f"{shard_name(shard)}/") for k in keys)


def crash_run_args(root: Path, model, data, **overrides) -> list[str]:
    """``hsextract run`` with small batches (many of them, so kill points fall mid-run) under ``root``."""
    options = {
        "layers": "0,3,7",
        "shards": 2,
        **TINY_LIMITS,
        "max_tokens_per_batch": 300,
        "max_rows": 8,
        "num_proc": 1,
        **overrides,
    }
    return cli_run_args(root, model, data, **options)


def copy_finished_run(reference: Path, root: Path) -> Path:
    """A finished run's output and run dir (``out``, ``run``) under ``root``, as if they had been made there: the
    copied run dir's config names the copied output (a run dir serves one output)."""
    import shutil

    shutil.copytree(reference / "out", root / "out")
    shutil.copytree(reference / "run", root / "run", ignore=shutil.ignore_patterns("locks"))
    config = root / "run" / "config.json"
    cfg = json.loads(config.read_text())
    cfg.update(output=str(root / "out"), run_dir=str(root / "run"))
    config.write_text(json.dumps(cfg))
    return root


def status(run_dir: Path, *extra, check=True):
    return run_cli("status", run_dir, *extra, timeout=60, check=check)


def status_json(run_dir: Path) -> dict:
    return json.loads(status(run_dir, "--json").stdout)
