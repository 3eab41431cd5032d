"""The command line: ``hsextract run | dry-run | status | finalize | verify | export | demo``. The only module that
imports click.

Options mirror RunConfig's fields; ``--config FILE.yaml`` fills them from a file (configs/), and options given on
the command line override it. User errors print one message and exit with status 2.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import click

from hsextract.config import RunConfig, load_yaml
from hsextract.errors import HsextractError
from hsextract.run.procs import Terminated, stop_on_signals
from hsextract.run.rundir import default_run_dir


def _user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HsextractError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("\ninterrupted: finished batches are kept; rerun the same command to resume", err=True)
            sys.exit(130)
        except Terminated as e:  # only where stop_on_signals was called: commands that run shards
            click.echo(
                f"\nterminated by {e.signal_name}: finished batches are kept; rerun the same command to resume"
            )
            sys.exit(e.exit_code)

    return wrapper


def _int_list(value):
    if value is None or isinstance(value, tuple):
        return value
    try:
        return tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None


def job_options(fn):
    options = [
        click.option(
            "--config",
            "config_file",
            type=click.Path(dir_okay=False),
            help="YAML file of options (configs/).",
        ),
        click.option("--model", help="Checkpoint directory or hub id of the target model."),
        click.option("--data", help="JSONL / JSON / Parquet file or datasets.save_to_disk directory."),
        click.option(
            "--layers", help="Decoder-layer ids whose OUTPUT is captured (e.g. 1,16,31), or dflash / eagle3."
        ),
        click.option("--max-length", type=int, help="Longer samples are truncated or skipped (--too-long)."),
        click.option("--too-long", type=click.Choice(["truncate", "skip"])),
        click.option("--max-tokens-per-batch", type=int, help="Bound on rows x longest row."),
        click.option(
            "--max-rows", type=int, help="Bound on rows per batch (<= 512 for linear-attention kernels)."
        ),
        click.option("--device", type=click.Choice(["cuda", "cpu"])),
        click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"])),
        click.option("--attn-implementation"),
        click.option(
            "--kernels",
            type=click.Choice(["fused", "stock"]),
            help="Fused CUDA kernels for qwen3_5 (default on CUDA) or transformers' stock forward (default on CPU).",
        ),
        click.option(
            "--final-state/--no-final-state",
            default=None,
            help="Also store the last layer's output before the final norm (EAGLE-3 trainers need it); "
            "implied by --layers eagle3.",
        ),
        click.option(
            "--storage-dtype",
            type=click.Choice(["float8_e4m3fn"]),
            help="Store states in fp8 with a float32 scale per token per layer (default: --dtype).",
        ),
        click.option(
            "--num-proc",
            type=int,
            help="Processes that tokenize the dataset (default: 1 below 16 MB of data or 4 cores, else up to 16).",
        ),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _build_config(**opts) -> RunConfig:
    values = load_yaml(opts.pop("config_file")) if opts.get("config_file") else {}
    opts.pop("config_file", None)
    for key, value in opts.items():
        if value is not None:
            values[key] = value
    for key in ("gpus",):
        if key in values:
            values[key] = _int_list(values[key])
    missing = [k for k in ("model", "data", "output") if not values.get(k)]
    if missing:
        raise HsextractError("missing " + ", ".join("--" + m for m in missing))
    if not values.get("run_dir"):
        node_rank = values.get("node_rank", 0) if values.get("nodes", 1) > 1 else None
        values["run_dir"] = str(default_run_dir(values["output"], node_rank))
        click.echo(f"run dir: {values['run_dir']} (from --output; rerun the same command here to resume)")
    try:
        return RunConfig(**values)
    except TypeError as e:
        raise HsextractError(str(e)) from None


@click.group()
@click.version_option(package_name="hsextract")
def main():
    """Extract hidden states of chosen decoder layers of a target model, for drafter training."""


@main.command()
@job_options
@click.option("--output", help="Local directory or s3://bucket/prefix for the batch files.")
@click.option(
    "--run-dir",
    help="Local directory for plan, token cache, logs and progress (resume from it); default "
    "./runs/<output name>-<hash of --output>.",
)
@click.option("--shards", type=int, help="Worker processes on this node, one per GPU.")
@click.option("--gpus", help="GPU indices for the shards, e.g. 0,1,2,3.")
@click.option("--staging", help="Staging directory (default /dev/shm/hsextract/<run>).")
@click.option(
    "--staging-max-gb", type=float, help="Staged GB per shard at which the worker waits for uploads."
)
@click.option("--s3-endpoint-url", help="S3-compatible endpoint (AWS_ENDPOINT_URL_S3 works too).")
@click.option("--nodes", type=int, help="Nodes running this job (default: from SLURM / NNODES, else 1).")
@click.option("--node-rank", type=int, help="This node's rank, 0..nodes-1 (default: from SLURM / NODE_RANK).")
@click.option(
    "--stall-timeout",
    "stall_timeout_s",
    type=float,
    help="Seconds without a heartbeat or a finished batch before a shard is reported stalled (default 180).",
)
@click.option(
    "--check-states/--no-check-states",
    default=None,
    help="Stop at a batch whose states hold NaN, Inf or all-zero tokens, naming batch and layer (default on).",
)
@click.option("--only-shards", help="Run only these shards, e.g. 2,3.")
@click.option(
    "--restart", is_flag=True, help="Discard the progress of a different previous plan in --run-dir."
)
@click.option("--no-progress", is_flag=True, help="No progress bars (logs only).")
@_user_errors
def run(only_shards, restart, no_progress, nodes, node_rank, **opts):
    """Extract hidden states; rerun the same command to resume after a crash."""
    from hsextract.run.cluster import node_place

    stop_on_signals()  # SIGTERM / SIGINT: workers stopped cleanly, and a word on how to resume
    from hsextract.prepare.steps import prepare_run
    from hsextract.run.launcher import launch
    from hsextract.run.rundir import RunDir

    place = node_place(nodes, node_rank)
    cfg = _build_config(nodes=place.nodes, node_rank=place.rank, **opts)
    if place.nodes > 1:
        click.echo(
            f"{place.describe()}: shards {cfg.local_shards[0]}..{cfg.local_shards[-1]} of {cfg.total_shards}"
        )
    if cfg.random_weights:
        raise HsextractError("random weights are for benchmarks only; `run` needs a real checkpoint")
    t0 = time.time()
    with RunDir(cfg.run_dir).launcher_lock(exclusive=restart):
        plan = prepare_run(cfg, restart=restart, echo=click.echo, show_progress=not no_progress)
        click.echo(
            f"prepared in {time.time() - t0:.1f} s; starting {cfg.shards} shard(s), logs in {cfg.run_dir}/logs"
        )
        code = launch(
            cfg, plan, only_shards=_int_list(only_shards), show_progress=not no_progress, echo=click.echo
        )
    sys.exit(code)


@main.command("dry-run")
@job_options
@click.option("--num-samples", default=8, show_default=True, help="Samples run through both paths.")
@click.option("--shards", type=int, help="Shards the ETA assumes (default 1).")
@click.option("--run-dir", help="Reuse this run dir's token cache (default: a temporary one).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@_user_errors
def dry_run_cmd(num_samples, as_json, run_dir, **opts):
    """Prove the layer ids against a plain HF forward, check state health, estimate size and time."""
    import tempfile

    from hsextract.dryrun import dry_run, format_report

    with tempfile.TemporaryDirectory(prefix="hsextract-dry-") as tmp:
        cfg = _build_config(output=tmp, run_dir=run_dir or tmp, **opts)
        result = dry_run(cfg, num_samples=num_samples)
    click.echo(json.dumps(result.report, indent=2) if as_json else format_report(result.report))
    sys.exit(0 if result.ok else 1)


@main.command()
@click.argument("run_dir", metavar="RUN_DIR|OUTPUT")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--s3-endpoint-url", help="S3-compatible endpoint, for an s3:// OUTPUT.")
@click.option(
    "--serve",
    is_flag=True,
    help="Serve a self-refreshing page, /metrics and /api/status over HTTP (RUN_DIR).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="With --serve: address to listen on.")
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="With --serve: port (0 picks a free one).",
)
@_user_errors
def status(run_dir, as_json, s3_endpoint_url, serve, host, port):
    """Per-shard progress of a run, live or finished. Given a run dir: this node's shards with rates and states.
    Given an output (s3://bucket/prefix or a directory): every node's and shard's progress, from the output alone."""
    from hsextract.run.progress import format_duration
    from hsextract.run.rundir import RunDir
    from hsextract.status.document import status_document

    if not RunDir(run_dir).is_run_dir() and _is_output(run_dir, s3_endpoint_url):
        if serve:
            raise HsextractError(
                f"--serve reads a run dir and {run_dir} is an output: give this node's run dir (runs/...)"
            )
        return _output_status(run_dir, s3_endpoint_url, as_json)
    if serve:
        from hsextract.status.serve import serve as serve_status

        serve_status(Path(run_dir), host=host, port=port, echo=click.echo)
        return
    doc = status_document(Path(run_dir))
    rows, complete = doc["shards"], doc["complete"]
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(
        f"{'shard':>5}  {'state':<22}{'batches':>13}  {'tokens':>21}  {'tok/s':>9}  {'eta':>8}  {'last progress':>13}"
    )
    for r in rows:
        eta = "" if r["eta_s"] is None else format_duration(r["eta_s"])
        age = (
            ""
            if r["progress_age_s"] is None or r["state"] == "done"
            else format_duration(r["progress_age_s"])
        )
        click.echo(
            f"{r['shard']:>5}  {r['state']:<22}{r['batches_done']:>6}/{r['batches_total']:<6}  "
            f"{r['tokens_done']:>10}/{r['tokens_total']:<10}  {r['tokens_per_s']:>9,.0f}  {eta:>8}  "
            f"{age + (' ago' if age else ''):>13}"
        )
        if r["state"] == "stalled":
            click.echo(
                f"       {r['stalled_process']} pid {r['stalled_pid']} stalled for "
                f"{format_duration(r['stalled_for_s'])}: {r['stall_reason']}; log: {r['log']}"
            )
        elif r["state"] == "stopped":
            click.echo(f"       {r['error'] or 'stopped'}; rerun the same command to resume; log: {r['log']}")
        elif r["state"] in ("crashed", "failed"):
            click.echo(f"       {r['error'] or 'no error recorded'}; log: {r['log']}")
        if r["damaged"]:
            click.echo(f"       progress file damaged: {r['damaged']} (the worker rewrites it while it runs)")
    total = sum(r["tokens_done"] for r in rows), sum(r["tokens_total"] for r in rows)
    click.echo(
        f"total {total[0]}/{total[1]} tokens; "
        + ("complete (manifest written)" if complete else "not complete")
    )


def _is_output(target: str, endpoint: str | None) -> bool:
    return "://" in target or (Path(target) / "hsextract").is_dir()


def _output_status(target: str, endpoint: str | None, as_json: bool) -> None:
    from hsextract.run.finalize import output_status
    from hsextract.storage import open_sink

    doc = output_status(open_sink(target, endpoint, retry_deadline_s=120))
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"{'node':>4} {'shard':>5}  {'state':<28}{'batches':>13}  {'tokens':>21}")
    for r in doc["shards"]:
        click.echo(
            f"{r['node']:>4} {r['shard']:>5}  {r['state']:<28}{r['batches_done']:>6}/{r['batches_total']:<6}  "
            f"{r['tokens_done']:>10}/{r['tokens_total']:<10}"
        )
    done = sum(r["tokens_done"] for r in doc["shards"])
    total = sum(r["tokens_total"] for r in doc["shards"])
    click.echo(
        f"total {done}/{total} tokens over {doc['nodes']} node(s); "
        + ("complete (manifest written)" if doc["complete"] else "not complete")
    )


@main.command()
@click.argument("output")
@click.option("--s3-endpoint-url", help="S3-compatible endpoint, for an s3:// OUTPUT.")
@_user_errors
def finalize(output, s3_endpoint_url):
    """Write OUTPUT's manifest if every batch of the job is done; checks each batch in the output first."""
    from hsextract.run.finalize import finalize_output
    from hsextract.storage import open_sink

    code, missing = finalize_output(open_sink(output, s3_endpoint_url), echo=click.echo)
    sys.exit(code or (1 if missing else 0))  # 0 only with the manifest written


@main.command()
@click.argument("output")
@click.option("--s3-endpoint-url", help="S3-compatible endpoint (AWS_ENDPOINT_URL_S3 works too).")
@click.option(
    "--workers", type=click.IntRange(min=1), default=8, show_default=True, help="Files checked at once."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@_user_errors
def verify(output, s3_endpoint_url, workers, as_json):
    """Check every file of a finished output against its manifest: size, CRC32, header and sample checksums.

    Prints each bad file with its problem and exits 1 if there is any."""
    from hsextract.verify import verify_output

    report = verify_output(output, s3_endpoint_url, workers=workers)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for e in report.bad:
            click.echo(f"BAD {e}")
        size = f"{report.bytes / 1e9:.2f} GB" if report.bytes >= 1e8 else f"{report.bytes / 1e6:.1f} MB"
        verdict = "all good" if report.ok else f"{len(report.bad)} bad"
        click.echo(f"verified {report.files} files ({size}) of {report.url}: {verdict}")
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("output")
@click.argument("dest")
@click.option(
    "--format",
    "fmt",
    required=True,
    type=click.Choice(["specforge-dflash", "specforge-eagle3", "speculators", "modelopt"]),
    help="The trainer's offline layout (docs/EXPORT.md).",
)
@click.option(
    "--draft-vocab", type=int, help="Also write the trainer's draft-vocabulary mapping for N tokens."
)
@click.option(
    "--target-vocab-size", type=int, help="Target vocabulary size, for outputs whose manifest lacks it."
)
@click.option("--num-proc", default=4, show_default=True, help="Processes writing export files.")
@click.option(
    "--s3-endpoint-url", help="S3-compatible endpoint for OUTPUT and DEST (AWS_ENDPOINT_URL_S3 works too)."
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@_user_errors
def export(output, dest, fmt, draft_vocab, target_vocab_size, num_proc, s3_endpoint_url, no_progress):
    """Rewrite a finished OUTPUT as the files a drafter trainer reads, into DEST; rerun to resume."""
    from hsextract.export.runner import export as run_export

    run_export(
        output,
        dest,
        fmt,
        draft_vocab=draft_vocab,
        target_vocab_size=target_vocab_size,
        num_proc=num_proc,
        endpoint_url=s3_endpoint_url,
        show_progress=not no_progress,
        echo=click.echo,
    )


@main.command()
@click.option("--root", default="demo", show_default=True, help="Where the tiny model, data and output go.")
@click.option("--shards", default=2, show_default=True)
@click.option("--conversations", default=300, show_default=True)
@_user_errors
def demo(root, shards, conversations):
    """The embedded default: build a tiny random qwen3_5 model and sample conversations, run on CPU, read back."""
    stop_on_signals()
    from hsextract.demo import build_demo
    from hsextract.prepare.steps import prepare_run
    from hsextract.reader import open_output
    from hsextract.run.launcher import launch

    root = Path(root).resolve()
    click.echo(f"building the tiny model and {conversations} conversations under {root}")
    model_dir, data = build_demo(root, conversations)
    cfg = RunConfig(
        model=str(model_dir),
        data=str(data),
        output=str(root / "output"),
        run_dir=str(root / "run"),
        layers="dflash",
        device="cpu",
        dtype="float32",
        shards=shards,
        max_length=1024,
        max_tokens_per_batch=4096,
        max_rows=64,
        staging=str(root / "staging"),
    )
    plan = prepare_run(cfg, echo=click.echo)
    code = launch(cfg, plan, echo=click.echo)
    if code:
        sys.exit(code)
    out = open_output(cfg.output)
    sample = out[out.sample_ids()[0]]
    click.echo(
        f"read back {len(out)} samples; sample {sample['sample_id']!r}: {len(sample['input_ids'])} tokens, "
        f"layers {list(sample['layers'])}, hidden_states {tuple(sample['hidden_states'].shape)}, "
        f"{int(sample['loss_mask'].sum())} loss tokens"
    )


if __name__ == "__main__":
    main()
