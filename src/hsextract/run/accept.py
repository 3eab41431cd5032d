"""Accepting a plan for a run dir and its output: resume only the same plan, ``--restart`` a different one (a finished
output only when the user confirms), claim the output for the plan or refuse an output another job holds."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.output import Plan, read_manifest
from hsextract.output.ledger import (
    claim_output,
    delete_manifest,
    describe_job,
    forget_job,
    has_manifest,
    job_record,
    read_job,
)
from hsextract.prepare.plan import fingerprint_changes
from hsextract.prepare.sources import changed_files
from hsextract.run.rundir import RunDir
from hsextract.storage import open_sink


def accept_plan(
    cfg: RunConfig,
    run_dir: RunDir,
    plan: Plan,
    *,
    restart: bool,
    echo=print,
    data: list[dict] | None = None,
    confirm=None,
) -> None:
    """Resume only the same plan; ``restart`` clears a different (or damaged) one, a finished output only if
    ``confirm(question)`` says so. Then claim the output. ``data``: the sources as described now, whose changed
    files a refusal names."""
    sink = open_sink(cfg.output, cfg.s3_endpoint_url)
    new_run_dir = not run_dir.plan_file.exists()
    if not new_run_dir:
        try:
            old = Plan.load(run_dir.plan_file)
        except HsextractError:
            if not restart:
                raise
            old = None
        # An equal plan has the same hash: comparing spares hashing the old one (seconds at 1M samples).
        if old is None or (old != plan and old.plan_hash != plan.plan_hash):
            if not restart:
                changes = fingerprint_changes(old.fingerprint, plan.fingerprint)
                if data is not None and run_dir.data_report_file.is_file():
                    try:
                        before = json.loads(run_dir.data_report_file.read_text()).get("sources") or []
                    except (OSError, ValueError, AttributeError):
                        before = []
                    changes += changed_files(before, data)
                if old.shards != plan.shards:
                    changes.append(f"shards: {old.shards} -> {plan.shards}")
                raise HsextractError(
                    f"run dir {run_dir.root} holds a different plan; resuming would mix two jobs. What changed:\n  "
                    + "\n  ".join(changes or ["the batches (same settings, different samples)"])
                    + "\nRerun with the original settings to resume, or add --restart to start over."
                )
            confirm_deletion(cfg, sink, confirm)
            reset_run(cfg, run_dir, sink, old, plan)
            echo(
                f"--restart: cleared progress and staging of the previous plan in {run_dir.root}, and its "
                f"manifest and batch files in {cfg.output}"
            )
    claim(cfg, sink, plan, new_run_dir=new_run_dir)


def claim(cfg: RunConfig, sink, plan: Plan, *, new_run_dir: bool) -> None:
    """Claim the output for this plan, or accept it if this plan holds it already (a rerun, another node, a lost
    run dir); refuse an output held by another job, naming it and what differs."""
    if new_run_dir and read_job(sink) is None:
        refuse_unclaimed_batches(cfg, sink, plan)
    job = job_record(
        plan=plan, nodes=cfg.nodes, run_dir=str(Path(cfg.run_dir).resolve()), host=socket.gethostname()
    )
    held = claim_output(sink, job)
    if held.get("plan_hash") == plan.plan_hash and held.get("nodes", 1) != cfg.nodes:
        raise HsextractError(
            f"output {cfg.output} is being written by this job on {held.get('nodes', 1)} node(s), but this node "
            f"was started as one of {cfg.nodes}: every node (and every rerun) must give the same node count"
        )
    if held.get("plan_hash") == plan.plan_hash:
        refuse_a_live_claimant(cfg, held)
    if held.get("plan_hash") != plan.plan_hash:
        changes = fingerprint_changes(held.get("fingerprint", {}), plan.fingerprint)
        if held.get("shards") != plan.shards:
            changes.append(f"shards: {held.get('shards')} -> {plan.shards} (nodes x shards per node)")
        raise HsextractError(
            f"output {cfg.output} is held by another job ({describe_job(held)}); two jobs never share an output. "
            + ("What differs:\n  " + "\n  ".join(changes) + "\n" if changes else "")
            + "Choose another --output, rerun that job's own command to resume it, or delete that output to "
            "reuse the place (docs/OPERATIONS.md)."
        )


def refuse_a_live_claimant(cfg: RunConfig, held: dict) -> None:
    """This job's output, claimed from another run dir on this host: if a run there is running this node's
    shards now, a second one would compute and upload the same batches beside it (and discard its partial
    uploads). A claimant on another host (another node of the job, or a lost run dir) is not seen from here."""
    who = held.get("started_by") or {}
    other = who.get("run_dir")
    if who.get("host") != socket.gethostname() or not isinstance(other, str):
        return
    if Path(other) == Path(cfg.run_dir).resolve():
        return
    holder = RunDir(other).shards_in_use(cfg.local_shards)
    if holder:
        raise HsextractError(
            f"output {cfg.output} is being written by another hsextract run ({holder}, run dir {other}): a "
            f"second run would race it on the same batches. Wait for it to finish (hsextract status {other}) "
            "or stop it first"
        )


def refuse_unclaimed_batches(cfg: RunConfig, sink, plan: Plan) -> None:
    """An output without a claim (written by an older hsextract, or by hand) may still hold batches: writing into
    it would mix two jobs' states without a trace."""
    if has_manifest(sink):
        other = read_manifest(sink).get("plan_hash")
        if other == plan.plan_hash:
            return  # the same job, finished before (its run dir was lost): rerunning rewrites identical batches
        raise HsextractError(
            f"output {cfg.output} already holds a finished run with another plan ({other}); "
            "choose a new --output, or delete that one first"
        )
    existing = sink.list_keys("shard-")
    if existing:
        raise HsextractError(
            f"output {cfg.output} already holds {len(existing)} batch file(s) (e.g. {existing[0]}) but run dir "
            f"{cfg.run_dir} is new, so nothing says which job wrote them: rerun with that job's --run-dir to "
            "resume it, or choose a new --output"
        )


def reset_run(cfg: RunConfig, run_dir: RunDir, sink, old: Plan | None, new: Plan) -> None:
    """--restart: forget the old plan (``None`` when its file is damaged) here and in the output."""
    # The manifest goes first: from here on the output is no longer the old plan's, and until the new manifest is
    # written it is not complete. Batch files the new plan does not overwrite would be left over from the old one.
    held = read_job(sink)
    # Another node of this job may have restarted the output onto the new plan first: then only local state goes.
    if held is None or held.get("plan_hash") != new.plan_hash:
        mine = held is not None and (
            (old is not None and held.get("plan_hash") == old.plan_hash)
            or held.get("started_by", {}).get("run_dir") == str(run_dir.root.resolve())
        )
        if held is not None and not mine:
            raise HsextractError(
                f"--restart: output {cfg.output} is held by another job ({describe_job(held)}), not this run dir's: "
                "nothing was cleared. Choose another --output."
            )
        delete_manifest(sink)
        old_keys = {b.key for b in old.batches} if old is not None else set(sink.list_keys("shard-"))
        for key in old_keys - {b.key for b in new.batches}:
            sink.delete(key)
        forget_job(sink)
    shutil.rmtree(run_dir.progress_dir, ignore_errors=True)
    shutil.rmtree(cfg.staging_dir, ignore_errors=True)
    run_dir.complete_file.unlink(missing_ok=True)


def confirm_deletion(cfg: RunConfig, sink, confirm) -> None:
    """A ``--restart`` that would delete a finished output (its manifest, the batch files the new plan does not
    rewrite) goes ahead only if ``confirm`` says so; else nothing is changed."""
    if not has_manifest(sink):
        return
    question = (
        f"--restart deletes the finished output {cfg.output} (its manifest, and the batch files the new plan does "
        "not rewrite) and starts over. Continue?"
    )
    if confirm is None or not confirm(question):
        raise HsextractError(
            f"--restart would delete the finished output {cfg.output}; nothing was changed. Add --yes to start over "
            "anyway, or choose another --output to keep it"
        )
