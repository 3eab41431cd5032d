"""The launcher's preflight: every check and every cheap step before any weight loads, as a short sequence of steps.

Bad input must fail in seconds, not after loading the weights, and a refused rerun must leave the run dir as it was:
``prepare_run`` checks places, files, model config, layers and output first, then tokenizes, plans, accepts the
plan (a held plan resumes only if identical), claims the output and writes the run files, the plan last.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from hsextract import startup
from hsextract.config import DTYPE_BYTES, RunConfig
from hsextract.devices import check_device
from hsextract.errors import HsextractError
from hsextract.layers import layer_types, presets_layer_ids, resolve_layer_ids
from hsextract.model.checkpoint import check_checkpoint, weights_fingerprint
from hsextract.model.config_record import recorded_model_config
from hsextract.model.fp8_load import run_compute
from hsextract.model.load import load_model_config, load_threads
from hsextract.model.qwen3_5 import check_shape as check_kernel_shape
from hsextract.model.target_topk import check_target_topk
from hsextract.output import Plan, StateLayout, run_file_metadata
from hsextract.output.ledger import RunInfo, publish_job_files, sample_ids_checksum
from hsextract.prepare.plan import make_plan
from hsextract.prepare.publish import prepare_once
from hsextract.prepare.rows import check_regenerated_rendering
from hsextract.prepare.served import turn_groups
from hsextract.prepare.sources import Mix, resolve_sources
from hsextract.prepare.tokenize import (
    DataReport,
    TokenizedSamples,
    load_samples,
    tokenizer_fingerprint,
    unique_sample_ids,
)
from hsextract.prepare.tokenizer_record import RecordedTokenizer, records_dir
from hsextract.run.accept import accept_plan
from hsextract.run.rundir import RunDir
from hsextract.storage import open_sink, preflight
from hsextract.storage.fileio import write_json
from hsextract.training.schemas import served_by, served_lines


@dataclass(frozen=True)
class ModelFacts:
    config: object
    text_config: object
    num_layers: int
    layer_ids: tuple[int, ...]
    layout: StateLayout
    presets: dict[str, list[int]]
    """Each preset the layers name -> its ids (empty for explicit ids): recorded in every file and the manifest."""


def run_layout(cfg: RunConfig, layer_ids: tuple[int, ...], num_layers: int) -> StateLayout:
    return StateLayout(layer_ids, num_layers, cfg.wants_final_state, cfg.storage_dtype, cfg.target_topk)


def prepare_run(
    cfg: RunConfig, *, restart: bool = False, echo=print, show_progress: bool = True, confirm=None
) -> Plan:
    """Validate everything, tokenize, plan; write the run files. Loads no weights. ``confirm(question)``: whether a
    ``restart`` may delete a finished output (None: it may not)."""
    check_places_and_files(cfg)
    return prepare_checked(cfg, restart=restart, echo=echo, show_progress=show_progress, confirm=confirm)


def check_places_and_files(cfg: RunConfig) -> None:
    """Step 1: the places and the model's files (a tokenizer, every weight file), no import; then the run dir made.
    Once this holds the launcher may begin start-up (run/job.py): the model's config, read next, imports
    transformers."""
    check_places(cfg)
    check_checkpoint(
        cfg.model_path, weights=not cfg.random_weights, tokenizer=cfg.tokenizer_dir or cfg.tokenizer
    )
    RunDir(cfg.run_dir).root.mkdir(parents=True, exist_ok=True)


def prepare_checked(
    cfg: RunConfig, *, restart: bool = False, echo=print, show_progress: bool = True, confirm=None
) -> Plan:
    """Steps 2 to 6, once ``check_places_and_files`` holds: the model and output checked, the data tokenized and
    planned, the plan accepted, the run files written; returns the plan."""
    run_dir = RunDir(cfg.run_dir)
    model = check_model_and_output(cfg)
    for line in served_lines(served_by(model.layer_ids, model.layout.final_state, model.presets)):
        echo(line)  # before the capture, what the export would refuse after it
    mix = resolve_data(cfg, run_dir)
    records = records_dir(run_dir.cache_dir)
    flag = "--tokenizer" if cfg.tokenizer else "--model"
    tokenizer = RecordedTokenizer(
        cfg.tokenizer_path, records, cfg.trust_remote_code, echo, flag
    )  # loaded if needed
    fingerprint = make_fingerprint(cfg, model, tokenizer, mix)
    # A multi-node job prepares once: node 0 publishes its tokens, the others take them (prepare/publish.py).
    with prepare_once(cfg, run_dir, mix, tokenizer, fingerprint, restart, echo) as once:
        samples, report, renamed = tokenize(
            cfg, tokenizer, run_dir, mix=mix, echo=echo, show_progress=show_progress
        )
        samples.check_ids_below(getattr(model.text_config, "vocab_size", None))
        plan = make_plan(
            samples.lengths.tolist(),
            max_tokens_per_batch=cfg.max_tokens_per_batch,
            max_rows=cfg.max_rows,
            shards=cfg.total_shards,
            fingerprint=fingerprint,
            groups=turn_groups(samples.sample_ids) if cfg.share_prefixes else None,
        )
        once.check_plan(plan)
        check_output_space(cfg, plan, model)
        accept_plan(cfg, run_dir, plan, restart=restart, echo=echo, data=mix.describe(), confirm=confirm)
        report_json = {**report.to_json(), "duplicate_ids_renamed": renamed}
        write_run_files(cfg, run_dir, plan, model, tokenizer, samples, report_json)
        once.publish(plan)
    echo(f"plan: {plan.summary()}")
    return plan


def check_inputs(cfg: RunConfig) -> ModelFacts:
    """The places and files, then the model config, the layer ids, the output and the staging space: fails fast,
    writes nothing."""
    check_places(cfg)
    check_checkpoint(
        cfg.model_path, weights=not cfg.random_weights, tokenizer=cfg.tokenizer_dir or cfg.tokenizer
    )
    return check_model_and_output(cfg)


def check_places(cfg: RunConfig) -> None:
    """The run dir (a directory, with room) serves this output, staging lies apart, and what start-up needs holds:
    no import, nothing written."""
    RunDir(cfg.run_dir).check_is_dir()
    RunDir(cfg.run_dir).check_space()
    check_same_output(cfg)
    check_no_overlap(cfg)
    if cfg.device == "cuda":
        load_threads()  # a bad HSEXTRACT_LOAD_THREADS fails here, not after tokenizing
    startup.check(cfg)  # a kernel cache the user chose can be written
    check_device(cfg)  # no CUDA, too few GPUs, a GPU already full: said now, not by a worker after preparing


def check_model_and_output(cfg: RunConfig) -> ModelFacts:
    """The model config and layer ids, the output (a probe object) and the staging space."""
    if cfg.kernel_mode == "fused" and cfg.device == "cuda":
        config, text, num_layers = load_model_config(cfg.model_path, cfg.trust_remote_code)
        check_kernel_shape(text)  # said now, not by every worker after preparing
    else:  # a model read before gives its recorded config: no transformers import
        records = records_dir(RunDir(cfg.run_dir).cache_dir)
        config, text, num_layers = recorded_model_config(cfg.model_path, records, cfg.trust_remote_code)
    layer_ids = resolve_layer_ids(cfg.layers, num_layers)
    layout = run_layout(cfg, layer_ids, num_layers)
    check_target_topk(cfg.target_topk, text)
    preflight(cfg.output, cfg.s3_endpoint_url)
    one_file = StateLayout.file_bytes(
        cfg.max_tokens_per_batch, 1, layout.bytes_per_token(text.hidden_size, DTYPE_BYTES[cfg.dtype])
    )
    check_staging(cfg.staging_dir, one_file, cfg.staging_max_gb)
    return ModelFacts(
        config=config,
        text_config=text,
        num_layers=num_layers,
        layer_ids=layer_ids,
        layout=layout,
        presets=presets_layer_ids(cfg.layers, num_layers),
    )


def output_identity(output: str) -> str:
    return output.rstrip("/") if "://" in output else str(Path(output).expanduser().resolve())


def check_same_output(cfg: RunConfig) -> None:
    """A run dir serves one output: its progress and staged files are that output's. Another output is
    another job, which gets its own run dir (the default one is per output)."""
    config_file = RunDir(cfg.run_dir).config_file
    if not config_file.is_file():
        return
    try:
        before = RunConfig.load(config_file).output
    except (HsextractError, TypeError):
        return  # a damaged config.json: the plan check says what to do
    if output_identity(before) != output_identity(cfg.output):
        raise HsextractError(
            f"run dir {cfg.run_dir} belongs to the job writing --output {before}, not {cfg.output}: a run dir "
            "serves one output. To write into the new output, give another --run-dir (or none: each output gets "
            f"its own); to resume the old job, give --output {before}"
        )


def check_no_overlap(cfg: RunConfig) -> None:
    """Staging is emptied as files are uploaded and cleared by --restart: it must not hold, or lie in, the
    output or the run dir."""
    staging = cfg.staging_dir.resolve()
    places = {"--run-dir": Path(cfg.run_dir).resolve()}
    if "://" not in cfg.output:
        places["--output"] = Path(cfg.output).resolve()
    for name, place in places.items():
        if staging == place or staging.is_relative_to(place) or place.is_relative_to(staging):
            raise HsextractError(
                f"the staging directory {staging} and {name} {place} overlap: staged files are deleted once "
                "uploaded, so they must live apart; choose another --staging"
            )


def check_staging(staging: Path, need_bytes: int, max_gb: float | None = None) -> None:
    """The staging directory must be writable and hold at least one batch file, within ``max_gb``
    (``--staging-max-gb``), else fail before any work. One made here goes again if still empty (the workers make
    it): a run refused later leaves none behind. The probe is this process's own: another run may be checking the
    same directory."""
    made = not staging.exists()
    try:
        staging.mkdir(parents=True, exist_ok=True)
        probe = staging / f".probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise HsextractError(
            f"staging directory {staging} is not writable ({e.strerror}); choose another with --staging"
        ) from None
    free = shutil.disk_usage(staging).free
    if made:
        try:
            staging.rmdir()
        except OSError:  # another run's shard directory is in it now
            pass
    if free < need_bytes:
        raise HsextractError(
            f"staging directory {staging} has {free / 1e9:.2f} GB free but one batch file needs up to "
            f"{need_bytes / 1e9:.2f} GB: free space there (is /dev/shm full?), point --staging elsewhere, "
            "or lower --max-tokens-per-batch"
        )
    if max_gb is not None and max_gb * 1e9 < need_bytes:
        raise HsextractError(
            f"--staging-max-gb {max_gb:g} is smaller than one batch file (up to {need_bytes / 1e9:.2f} GB at "
            f"--max-tokens-per-batch and these layers): give --staging-max-gb {math.ceil(need_bytes / 1e9)} or "
            "more (room for several lets the GPU run on while they upload), or lower --max-tokens-per-batch"
        )


def check_output_space(cfg: RunConfig, plan: Plan, model: ModelFacts) -> None:
    """A local output must have room for the plan's batch files not there yet: the plan knows their size, and a
    file system that fills mid-run (a RAM disk fills the host's memory) fails far later and worse."""
    if "://" in cfg.output:
        return
    out = Path(cfg.output)
    token_bytes = model.layout.bytes_per_token(model.text_config.hidden_size, DTYPE_BYTES[cfg.dtype])
    todo = [b for b in plan.batches if not (out / b.key).is_file()]
    need = sum(StateLayout.file_bytes(b.num_tokens, b.rows, token_bytes) for b in todo)
    free = shutil.disk_usage(out).free
    if free < need:
        raise HsextractError(
            f"output directory {out} has {free / 1e9:.3f} GB free but the plan's {len(todo)} batch file(s) still "
            f"to write need about {need / 1e9:.3f} GB: free space there or choose another --output"
        )


def resolve_data(cfg: RunConfig, run_dir: RunDir) -> Mix:
    """Every data source found and checked (a missing path, column or bucket fails here, naming the source; replies
    regenerated under other template arguments too); S3 objects are fetched into the run dir's cache."""
    try:
        mix = resolve_sources(
            cfg.data, seed=cfg.seed, cache_dir=run_dir.cache_dir, s3_endpoint_url=cfg.s3_endpoint_url
        )
    except HsextractError as e:
        if not run_dir.plan_file.exists():
            raise
        raise HsextractError(
            f"{e}\nThe run in {run_dir.root} was prepared from this data: to resume it, put the data back as it "
            "was; to start over with other data, give --restart"
        ) from None
    check_regenerated_rendering(mix.describe(), cfg.template_kwargs)  # before a token is made
    return replace(mix, limit=cfg.max_samples)


def tokenize(
    cfg: RunConfig,
    tokenizer,
    run_dir: RunDir,
    *,
    mix: Mix | None = None,
    echo=print,
    show_progress: bool = True,
) -> tuple[TokenizedSamples, DataReport, int]:
    """Every row tokenized and masked (cached in the run dir); returns samples, report and renamed-id count."""
    samples, report = load_samples(
        mix if mix is not None else resolve_data(cfg, run_dir),
        tokenizer,
        num_proc=cfg.num_proc,
        progress=show_progress,
        **encoding_options(cfg, run_dir),
    )
    echo(f"data: {report.summary()}")
    if len(report.sources) > 1:
        for line in report.source_lines():
            echo(f"  {line}")
    for line in report.regenerated_lines():
        echo(f"  {line}")
    for line in report.first_problems():
        echo(f"  {line}")
    report.check_bad_rows(cfg.max_bad_rows)
    if cfg.max_bad_rows is None and (warning := report.mostly_dropped()):
        echo(warning)
    samples, renamed = unique_sample_ids(samples)
    if renamed:
        echo(
            f"warning: {renamed} row(s) repeat an earlier row's id; renamed to id#2, id#3, ... "
            f"(see {run_dir.data_report_file.name})"
        )
    return samples, report, renamed


def encoding_options(cfg: RunConfig, run_dir: RunDir) -> dict:
    """How the run's rows become tokens (``load_samples``, and dry-run's ``load_sample``): limits, dedupe, the
    chat template and its arguments, and the run dir's token cache."""
    return dict(
        max_length=cfg.max_length,
        too_long=cfg.too_long,
        cache_dir=run_dir.cache_dir,
        dedupe=cfg.dedupe,
        chat=cfg.chat_options,
    )


def model_identity(cfg: RunConfig, config) -> dict:
    """The model as named, and what pins its content: the snapshot's commit, the config's and weights' hashes."""
    model_dir = Path(cfg.model_path)
    config_file = model_dir / "config.json"
    digest = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16] if config_file.exists() else ""
    return {
        "model": cfg.model,
        "model_revision": cfg.model_commit or getattr(config, "_commit_hash", None) or "",
        "model_config_hash": digest,
        "model_weights_hash": weights_fingerprint(model_dir),
        **({"trust_remote_code": True} if cfg.trust_remote_code else {}),
    }


def make_fingerprint(cfg: RunConfig, model: ModelFacts, tokenizer, mix: Mix) -> dict:
    """Everything that shapes the output; a rerun whose fingerprint differs is a different job."""
    return {
        **mix.fingerprint(),
        **tokenizer_fingerprint(tokenizer),
        **cfg.chat_options.fingerprint(),  # a given template's hash replaces the tokenizer's
        **(
            {"tokenizer": cfg.tokenizer, "tokenizer_revision": cfg.tokenizer_commit or ""}
            if cfg.tokenizer
            else {}
        ),
        **model_identity(cfg, model.config),
        "layer_ids": list(model.layer_ids),
        "dtype": cfg.dtype,
        "max_length": cfg.max_length,
        "too_long": cfg.too_long,
        "max_tokens_per_batch": cfg.max_tokens_per_batch,
        "max_rows": cfg.max_rows,
        "random_weights": cfg.random_weights,
        # Only when set, so that the plans of runs without them hash as they did before these options existed.
        **({"final_state": True} if model.layout.final_state else {}),
        **({"storage_dtype": cfg.storage_dtype} if cfg.storage_dtype else {}),
        **({"compute": "fp8"} if run_compute(cfg) == "fp8" else {}),
        **({"target_topk": cfg.target_topk} if cfg.target_topk else {}),
        **({"dedupe": True} if cfg.dedupe else {}),
        **({"share_prefixes": True} if cfg.share_prefixes else {}),  # batches of whole conversations
        # A lone dflash or eagle3 hashes as before presets were recorded; every other preset set is part of the job.
        **({"presets": model.presets} if set(model.presets) not in (set(), {"dflash"}, {"eagle3"}) else {}),
    }


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
    sample_ids_json = json.dumps(samples.sample_ids).encode()
    info = RunInfo(
        layer_ids=model.layer_ids,
        layer_types=tuple(layer_types(model.text_config)[k] for k in model.layer_ids),
        num_layers=model.num_layers,
        hidden_size=model.text_config.hidden_size,
        pad_token_id=tokenizer.pad_token_id,
        plan_hash=plan.plan_hash,
        final_state=model.layout.final_state,
        storage_dtype=model.layout.storage_dtype,
        vocab_size=getattr(model.text_config, "vocab_size", None),
        presets=model.presets,
        target_topk=model.layout.target_topk,
        sample_ids_sha256=sample_ids_checksum(sample_ids_json),
        file_metadata=run_file_metadata(
            layout=model.layout,
            presets=model.presets,
            model=cfg.model,
            model_revision=fp["model_revision"],
            model_config_hash=fp["model_config_hash"],
            dtype=cfg.dtype,
            hidden_size=model.text_config.hidden_size,
            tokenizer_hash=fp["tokenizer_hash"],
            chat_template_hash=fp["chat_template_hash"],
            plan_hash=plan.plan_hash,
            kernels=cfg.kernel_mode,
            compute=run_compute(cfg),
        ),
    )
    cfg.save(run_dir.config_file)
    info.save(run_dir)
    plan.save(run_dir.plan_file)
    files = dict(plan=plan.to_json(), info=info.to_json(), samples=sample_ids_json, data_report=data_report)
    publish_job_files(open_sink(cfg.output, cfg.s3_endpoint_url), files)
