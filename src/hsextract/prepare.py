"""Prepare a run: every check and every cheap step before any weight loads, as a short sequence of named steps.

Bad input must fail in seconds, not after loading 54 GB of weights, and a refused rerun must leave the run dir as
it was. So ``prepare_run`` goes:

1. ``check_inputs``: the model config and layer ids, the output (a probe object), the staging directory's space;
2. ``tokenize``: every row of the dataset (parallel, cached in the run dir, bad rows counted), ids made unique;
3. ``make_fingerprint`` and ``make_plan``: what shapes the output, and the batches dealt to shards;
4. ``accept_plan``: a run dir that already holds a plan is resumed only if the new plan is identical; otherwise
   the message says what changed, and ``--restart`` clears the old plan's progress and output first; a new run
   dir must not write into an output that holds another job's batches;
5. ``write_run_files``: data report, tokens, config, run info and, last, the plan.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from .capture import layer_types, load_model_config, resolve_layer_ids
from .config import DTYPE_BYTES, RunConfig
from .data import (
    DataReport,
    TokenizedSamples,
    data_fingerprint,
    load_samples,
    load_tokenizer,
    tokenizer_fingerprint,
    unique_sample_ids,
)
from .errors import HsextractError
from .output import delete_manifest, estimate_file_bytes, has_manifest, read_manifest, run_file_metadata
from .plan import Plan, fingerprint_changes, make_plan
from .rundir import RunDir, RunInfo, write_json
from .storage import open_sink, preflight


@dataclass(frozen=True)
class ModelFacts:
    config: object
    text_config: object
    num_layers: int
    layer_ids: tuple[int, ...]


def prepare_run(cfg: RunConfig, *, restart: bool = False, echo=print, show_progress: bool = True) -> Plan:
    """Validate everything, tokenize, plan; write the run files. Loads no weights."""
    run_dir = RunDir(cfg.run_dir)
    model = check_inputs(cfg)
    run_dir.root.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg.model)
    samples, report, renamed = tokenize(cfg, tokenizer, run_dir, echo=echo, show_progress=show_progress)
    fingerprint = make_fingerprint(cfg, model, tokenizer)
    plan = make_plan(
        samples.lengths.tolist(),
        max_tokens_per_batch=cfg.max_tokens_per_batch,
        max_rows=cfg.max_rows,
        shards=cfg.shards,
        fingerprint=fingerprint,
    )
    accept_plan(cfg, run_dir, plan, restart=restart, echo=echo)
    write_run_files(
        cfg, run_dir, plan, model, tokenizer, samples, {**report.to_json(), "duplicate_ids_renamed": renamed}
    )
    echo(f"plan: {plan.summary()}")
    return plan


def check_inputs(cfg: RunConfig) -> ModelFacts:
    """The model config, the layer ids, the output and the staging space: fails fast, writes nothing."""
    config, text, num_layers = load_model_config(cfg.model)
    layer_ids = resolve_layer_ids(cfg.layers, num_layers)
    preflight(cfg.output, cfg.s3_endpoint_url)
    one_file = estimate_file_bytes(
        cfg.max_tokens_per_batch, 1, len(layer_ids), text.hidden_size, DTYPE_BYTES[cfg.dtype]
    )
    check_staging(cfg.staging_dir, one_file)
    return ModelFacts(config=config, text_config=text, num_layers=num_layers, layer_ids=layer_ids)


def check_staging(staging: Path, need_bytes: int) -> None:
    """The staging directory must be writable and hold at least one batch file, else fail before any work."""
    try:
        staging.mkdir(parents=True, exist_ok=True)
        probe = staging / ".probe"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise HsextractError(
            f"staging directory {staging} is not writable ({e.strerror}); choose another with --staging"
        ) from None
    free = shutil.disk_usage(staging).free
    if free < need_bytes:
        raise HsextractError(
            f"staging directory {staging} has {free / 1e9:.2f} GB free but one batch file needs up to "
            f"{need_bytes / 1e9:.2f} GB: free space there (is /dev/shm full?), point --staging elsewhere, "
            "or lower --max-tokens-per-batch"
        )


def tokenize(
    cfg: RunConfig, tokenizer, run_dir: RunDir, *, echo=print, show_progress: bool = True
) -> tuple[TokenizedSamples, DataReport, int]:
    """Every row tokenized and masked (cached in the run dir); returns samples, report and renamed-id count."""
    samples, report = load_samples(
        cfg.data,
        tokenizer,
        max_length=cfg.max_length,
        too_long=cfg.too_long,
        num_proc=cfg.num_proc,
        cache_dir=run_dir.cache_dir,
        progress=show_progress,
    )
    echo(f"data: {report.summary()}")
    samples, renamed = unique_sample_ids(samples)
    if renamed:
        echo(
            f"warning: {renamed} row(s) repeat an earlier row's id; renamed to id#2, id#3, ... "
            f"(see {run_dir.data_report_file.name})"
        )
    return samples, report, renamed


def model_identity(model: str, config) -> dict:
    config_file = Path(model) / "config.json"
    digest = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16] if config_file.exists() else ""
    return {
        "model": model,
        "model_revision": getattr(config, "_commit_hash", None) or "",
        "model_config_hash": digest,
    }


def make_fingerprint(cfg: RunConfig, model: ModelFacts, tokenizer) -> dict:
    """Everything that shapes the output; a rerun whose fingerprint differs is a different job."""
    return {
        "data": data_fingerprint(cfg.data),
        **tokenizer_fingerprint(tokenizer),
        **model_identity(cfg.model, model.config),
        "layer_ids": list(model.layer_ids),
        "dtype": cfg.dtype,
        "max_length": cfg.max_length,
        "too_long": cfg.too_long,
        "max_tokens_per_batch": cfg.max_tokens_per_batch,
        "max_rows": cfg.max_rows,
        "random_weights": cfg.random_weights,
    }


def accept_plan(cfg: RunConfig, run_dir: RunDir, plan: Plan, *, restart: bool, echo=print) -> None:
    """Resume only the same plan; ``restart`` clears a different one. A new run dir must own its output."""
    if not run_dir.plan_file.exists():
        refuse_foreign_output(cfg, plan)
        return
    old = Plan.load(run_dir.plan_file)
    if old.plan_hash == plan.plan_hash:
        return
    if not restart:
        changes = fingerprint_changes(old.fingerprint, plan.fingerprint)
        if old.shards != plan.shards:
            changes.append(f"shards: {old.shards} -> {plan.shards}")
        raise HsextractError(
            f"run dir {run_dir.root} holds a different plan; resuming would mix two jobs. What changed:\n  "
            + "\n  ".join(changes or ["the batches (same settings, different samples)"])
            + "\nRerun with the original settings to resume, or add --restart to start over."
        )
    reset_run(cfg, run_dir, old, plan)
    echo(
        f"--restart: cleared markers, progress and staging of the previous plan in {run_dir.root}, and its "
        f"manifest and batch files in {cfg.output}"
    )


def refuse_foreign_output(cfg: RunConfig, plan: Plan) -> None:
    """A new run dir must not write into an output that holds another run's batches: keys would collide and the
    result would mix two jobs' states without a trace."""
    sink = open_sink(cfg.output, cfg.s3_endpoint_url)
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


def reset_run(cfg: RunConfig, run_dir: RunDir, old: Plan, new: Plan) -> None:
    # The manifest goes first: from here on the output is no longer the old plan's, and until the new manifest is
    # written it is not complete. Batch files the new plan does not overwrite would be left over from the old one.
    sink = open_sink(cfg.output, cfg.s3_endpoint_url)
    delete_manifest(sink)
    for key in {b.key for b in old.batches} - {b.key for b in new.batches}:
        sink.delete(key)
    shutil.rmtree(run_dir.markers_dir, ignore_errors=True)
    shutil.rmtree(run_dir.progress_dir, ignore_errors=True)
    shutil.rmtree(cfg.staging_dir, ignore_errors=True)
    run_dir.complete_file.unlink(missing_ok=True)


def write_run_files(
    cfg: RunConfig,
    run_dir: RunDir,
    plan: Plan,
    model: ModelFacts,
    tokenizer,
    samples: TokenizedSamples,
    data_report: dict,
) -> None:
    """Written only once the plan is accepted (a refused rerun leaves the run dir as it was); the plan last."""
    write_json(run_dir.data_report_file, data_report)
    samples.save(run_dir.tokens_file)
    fp = plan.fingerprint
    info = RunInfo(
        layer_ids=model.layer_ids,
        layer_types=tuple(layer_types(model.text_config)[k] for k in model.layer_ids),
        num_layers=model.num_layers,
        hidden_size=model.text_config.hidden_size,
        pad_token_id=tokenizer.pad_token_id,
        plan_hash=plan.plan_hash,
        file_metadata=run_file_metadata(
            layer_ids=model.layer_ids,
            model=cfg.model,
            model_revision=fp["model_revision"],
            model_config_hash=fp["model_config_hash"],
            dtype=cfg.dtype,
            hidden_size=model.text_config.hidden_size,
            tokenizer_hash=fp["tokenizer_hash"],
            chat_template_hash=fp["chat_template_hash"],
            plan_hash=plan.plan_hash,
        ),
    )
    cfg.save(run_dir.config_file)
    info.save(run_dir)
    plan.save(run_dir.plan_file)
