"""Run the shards of a prepared run (preflight.py) to completion, then finish the output.

One worker process per shard, started by start-up (hsextract/startup/) to die with the launcher. The output's
completion records decide which shards start; once every worker has exited 0, ``finalize`` checks each batch against
its record and writes the manifest, last: a batch found missing or damaged there sends its shard round once more.
SIGTERM or SIGINT stop every worker (SIGKILL after ``STOP_GRACE_S``) and exit with 128 + the signal.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.output import Plan
from hsextract.output.ledger import (
    done_in_output,
    has_manifest,
    ready_manifest,
    shard_name,
    write_final_manifest,
)
from hsextract.run.procs import Terminated, die_with_parent, wait_or_kill
from hsextract.run.progress import ShardProgress, rate_text
from hsextract.run.rundir import RunDir
from hsextract.run.stalls import StallWatch
from hsextract.startup import Startup, begin
from hsextract.storage import open_sink
from hsextract.storage.fileio import atomic_write

STOP_GRACE_S = 30.0

"""How long stopped workers get to kill their uploaders and record their state before they are killed."""


# Not `-m hsextract.run.worker`: the worker starts its uploader with `spawn`, which re-imports the parent's __main__
# module in the child, and that module imports torch. A `-c` program leaves the child nothing to re-import. Start-up's
# `arrive` comes before the worker's imports: an early worker pins its host buffers in a thread beside them.
WORKER_ENTRY = (
    "from hsextract.run.procs import exit_now\n"
    "from hsextract.startup import arrive\n"
    "if not arrive(program='hsextract.run.worker'):\n"
    "    exit_now(0)\n"
    "from hsextract.run.worker import main\n"
    "exit_now(main())\n"
)


def _die_with_launcher():
    """``preexec_fn`` for a child of this launcher: it dies with the launcher, even one killed mid-fork."""
    return functools.partial(die_with_parent, os.getpid())


def begin_startup(cfg: RunConfig, shards=None) -> Startup:
    """Start-up for ``shards`` (default: this node's; hsextract/startup/), begun once the places are checked: on
    CUDA the early workers start now, so that their imports overlap the preparation."""
    return begin(
        cfg, RunDir(cfg.run_dir).startup, program=WORKER_ENTRY, preexec_fn=_die_with_launcher(), shards=shards
    )


def launch(
    cfg: RunConfig, plan: Plan, *, only_shards=None, show_progress: bool = True, echo=print, startup=None
) -> int:
    """Run the shards to completion and finish the output; returns the process exit code: 0 only once every batch
    of this node's shards is checked in the output and, if the whole job is done, the manifest is written (on one
    node: 0 means the manifest is written and holds).

    The output's completion records decide what is done: a shard is started unless the output records all its
    batches, and its worker recomputes every batch whose record or object is missing or does not match. A batch
    found missing or damaged by ``finalize`` (deleted or damaged behind the run's back) loses its record, and its
    shard is run once more, which recomputes exactly those batches.

    ``startup`` (``begin_startup``) starts the workers, taking those started before the plan was ready; one is
    begun here if none is given."""
    shards = owned = chosen_shards(cfg, only_shards)
    startup = startup or begin_startup(cfg, owned)
    try:
        for attempt in range(2):
            code = _run_shards(cfg, plan, shards, startup, show_progress=show_progress, echo=echo)
            if code:
                return code
            code, missing = finalize(cfg, plan, echo=echo)
            if code == 0 and not missing:
                return 0
            missing = {b.key for b in plan.batches if b.key in missing and b.shard in shards}
            if not missing:
                return code  # only other nodes' (or shards not run here) batches are still to do
            shards = sorted({b.shard for b in plan.batches if b.key in missing})
            if attempt == 0:
                echo(f"recomputing {len(missing)} batch(es) of shard(s) {shards}")
        echo("the output still lacks batches after recomputing them; see the messages above")
        return 1
    finally:  # failed or stopped too: what a resume needs is in files, and a directory holding one stays
        startup.close()
        remove_empty_staging(cfg, owned)


def chosen_shards(cfg: RunConfig, only_shards=None) -> list[int]:
    """The shards this run runs: ``--only-shards``, else every shard of this node."""
    local = cfg.local_shards
    shards = sorted(only_shards) if only_shards else local
    bad = [s for s in shards if s not in local]
    if bad:
        raise HsextractError(f"--only-shards {bad}: this node runs shards {local[0]}..{local[-1]}")
    return shards


def _run_shards(
    cfg: RunConfig, plan: Plan, shards: list[int], startup: Startup, *, show_progress: bool, echo
) -> int:
    run_dir = RunDir(cfg.run_dir)
    # One listing of the completion records picks the shards to start; each worker checks its own records against
    # the objects (resume.py), and finalize checks every batch of a shard not started before the manifest.
    keys = {b.key for s in shards for b in plan.for_shard(s)}
    done = done_in_output(open_sink(cfg.output, cfg.s3_endpoint_url))
    todo = [s for s in shards if any(b.key not in done for b in plan.for_shard(s))]
    in_output = keys & set(done)  # done: key -> its record
    if in_output and todo:
        echo(
            f"resuming: {len(in_output)} of {len(keys)} batches are in the output already; "
            f"{len(keys - in_output)} to do in shard(s) {todo}"
        )
    complete = [s for s in shards if s not in todo and plan.for_shard(s)]
    if complete:
        echo(f"shards already complete: {complete}")
    if todo:
        run_dir.check_space()  # after the token cache and run files took theirs
    procs = startup.start_workers(plan, todo, echo=echo)
    bars = _Bars(run_dir, plan, todo, enabled=show_progress)
    say = bars.write_with(echo)
    stalls = StallWatch(run_dir, cfg.stall_timeout_s, echo=say)
    failed: dict[int, int] = {}
    try:
        while procs:
            startup.poll(echo=say)  # the kernel warm-up's end, for the workers waiting on it
            for s, p in list(procs.items()):
                rc = p.poll()
                if rc is not None:
                    del procs[s]
                    if rc != 0:
                        failed[s] = rc
                    else:
                        stalls.finished(s)
            progress = {s: ShardProgress.load(run_dir, s) for s in todo}
            for s, p in procs.items():
                stalls.check(s, p, progress[s])
            bars.update(progress)
            time.sleep(0.25)
    except Terminated as e:
        startup.stop_warmup()
        killed = _stop_workers(procs, e.signum)
        bars.close()
        for s in killed:
            echo(
                f"shard {s}: its worker did not stop within {STOP_GRACE_S:.0f} s of {e.signal_name} and was "
                f"killed; its log: {run_dir.log_file(s)}"
            )
        stopped = sorted(procs)
        n_done = _in_output_now(cfg, keys)
        counted = f"{n_done} of {len(keys)}" if n_done is not None else "the finished"
        echo(
            f"terminated by {e.signal_name}: stopped shard(s) {stopped}; {counted} batches are in "
            f"the output and kept.\nRerun the same command to resume (hsextract status {run_dir.root} shows "
            "each shard)."
        )
        return e.exit_code
    finally:
        startup.stop_warmup()
        bars.close()
    for s, rc in sorted(failed.items()):
        echo(failure_message(run_dir, s, rc))
    if failed:
        echo("Rerun the same command to resume: finished batches are kept.")
        return 1
    return 0


def _in_output_now(cfg: RunConfig, keys: set[str]) -> int | None:
    """The batches the output records done, counted as the rerun's "resuming:" line counts them (one listing, a
    short deadline: the user is waiting); None where the output does not answer at once."""
    try:
        return len(keys & done_in_output(open_sink(cfg.output, cfg.s3_endpoint_url, retry_deadline_s=10)))
    except Exception:  # the count is a courtesy; the stop must not wait on an outage
        return None


def _stop_workers(procs: dict[int, subprocess.Popen], signum: int = signal.SIGTERM) -> list[int]:
    """The launcher's stop signal (SIGTERM or SIGINT: each worker then records the one the user sent), and
    SIGCONT for a worker stopped with SIGSTOP, to every worker; SIGKILL after ``STOP_GRACE_S``. Returns the
    shards whose workers had to be killed."""
    for p in procs.values():
        for sig in (signum, signal.SIGCONT):
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    killed = wait_or_kill(procs.values(), STOP_GRACE_S)
    return sorted(s for s, p in procs.items() if p in killed)


def failure_message(run_dir: RunDir | Path, shard: int, returncode: int) -> str:
    """Why a shard's worker exited non-zero, and where its logs are."""
    run_dir = RunDir(run_dir)
    prog = ShardProgress.load(run_dir, shard)
    if prog and prog.state == "failed" and prog.error:
        why = f": {prog.error}"
    elif returncode < 0:
        # Killed by a signal: the worker wrote nothing about it, and the last line of its output is whatever ran
        # last (often a warning from a dying child's resource tracker), not the reason.
        why = ""
    elif note := run_dir.low_space_note():  # nothing recorded, and its last words cut short if any
        why = f": {note}"
    else:  # died before it could record why (or refused to touch the progress file): its last words
        why = _last_line(run_dir.log_file(shard, "stderr"))
        why = f": {why}" if why else ""
    return (
        f"shard {shard} failed ({_exit_reason(returncode)}){why}\n  log: {run_dir.log_file(shard)}\n"
        f"  output: {run_dir.log_file(shard, 'stderr')}"
    )


def _last_line(path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _exit_reason(returncode: int) -> str:
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    # SIGKILL that no one sent by hand is most often the kernel's out-of-memory killer.
    return f"killed by {name}" + (", out of host memory?" if name == "SIGKILL" else "")


def finalize(cfg: RunConfig, plan: Plan, echo=print) -> tuple[int, set[str]]:
    """Once this node's shards are done: write the manifest if the whole job is done (finalize.py checks every
    batch in the output first, and removes the records of those missing or damaged). Returns the exit code and the
    keys of every batch not done in the output: still to do, missing or damaged."""
    run_dir = RunDir(cfg.run_dir)
    sink = open_sink(cfg.output, cfg.s3_endpoint_url)
    code, missing = finish_output(sink, echo=echo)
    mine = {b.key for b in plan.batches if b.shard in cfg.local_shards} & missing
    if code and missing - mine:
        echo(
            f"{len(missing - mine)} damaged batch(es) belong to other nodes' shards: rerun those nodes' commands"
        )
    if code == 0 and not missing and has_manifest(sink):
        atomic_write(run_dir.complete_file, plan.plan_hash)
    return code, missing


def finish_output(sink, echo=print) -> tuple[int, set[str]]:
    """The output finished from the output alone (output/finalize.py), by this node or ``hsextract finalize``: every
    batch checked, then the sample index (the trainers' rule: which samples each schema leaves out), then the
    manifest, last. Returns the exit code and the keys of every batch not done (empty: the manifest is written)."""
    code, missing, manifest = ready_manifest(sink, echo=echo)
    if manifest is None:
        return code, missing
    from hsextract.training.index import write_sample_index  # torch: only once every batch is done

    return write_final_manifest(sink, manifest, *write_sample_index(sink, manifest), echo=echo)


def remove_empty_staging(cfg: RunConfig, shards: list[int]) -> None:
    """Remove the staging directories of ``shards`` (this run's own, ``RunDir.owning_shards``) that are empty, so
    that a finished, failed or stopped run leaves no empty directory in /dev/shm; then the run dir's staging
    directory and the default staging root, each only if empty (another run's shard directory keeps them). A
    directory that still holds anything (staged files a resume uploads) is left alone."""
    staging = cfg.staging_dir
    dirs = [staging / shard_name(s) for s in shards] + [staging]
    if cfg.staging is None:
        dirs.append(staging.parent)
    for d in dirs:
        try:
            d.rmdir()
        except OSError:  # absent, or not empty
            pass


class _Bars:
    """One tqdm bar per shard, fed from the progress files the workers write."""

    def __init__(self, run_dir: RunDir, plan: Plan, shards, enabled: bool):
        self.run_dir, self.shards, self.bars = run_dir, shards, {}
        self.closed = False
        if not enabled:
            return
        from tqdm import tqdm

        # On a terminal the bars redraw in place; in a log file a line every 30 s is plenty.
        interval = 0.5 if sys.stderr.isatty() else 30.0
        for pos, s in enumerate(shards):
            total = sum(b.num_tokens for b in plan.for_shard(s))
            self.bars[s] = tqdm(
                total=total,
                desc=f"shard {s}",
                unit="tok",
                unit_scale=True,
                position=pos,
                dynamic_ncols=True,
                leave=True,
                mininterval=interval,
                # Not tqdm's own rate and ETA (time since the bar appeared, the model's load included): the
                # shard's, the one `status` shows (progress.ShardProgress.tokens_per_s).
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )
        self.seen = {s: (0, "") for s in shards}

    def update(self, progress: dict[int, ShardProgress | None] | None = None) -> None:
        """Redraw from ``progress`` (each shard's, as the launcher's loop read it), or from the files."""
        for s, bar in self.bars.items():
            p = progress[s] if progress is not None else ShardProgress.load(self.run_dir, s)
            if p is None or (p.tokens_done, p.state) == self.seen[s]:
                continue
            self.seen[s] = (p.tokens_done, p.state)
            bar.set_postfix_str(rate_text(p), refresh=False)
            bar.update(p.tokens_done - bar.n)

    def write_with(self, echo):
        """``echo`` that first clears the bars from a terminal, so that a line printed between redraws stays. Not
        in a log file: there the bars are plain lines, and clearing them would write escape codes."""
        if not self.bars or not sys.stderr.isatty():
            return echo

        def write(message: str) -> None:
            from tqdm import tqdm

            with tqdm.external_write_mode():
                echo(message)

        return write

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.update()
        for bar in self.bars.values():
            bar.close()
