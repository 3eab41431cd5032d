"""The command line: ``hsextract run | regenerate | dry-run | layers | status | finalize | verify | export | demo``.
The only module that imports click.

Options mirror RunConfig's fields; ``--config FILE.yaml`` fills them from a file (configs/), and options given on
the command line override it. User errors print one message and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from hsextract.config import REQUIRED, RunConfig, load_yaml
from hsextract.config import field_docs as config_field_docs
from hsextract.errors import HsextractError, disk_full, install_redaction
from hsextract.regenerate.config import REQUIRED as REGENERATE_REQUIRED
from hsextract.regenerate.config import RegenerateConfig
from hsextract.run.procs import Terminated, steady_echo, stop_on_signals
from hsextract.run.rundir import default_run_dir


def _user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HsextractError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except OSError as e:  # a full file system (the run dir's, while preparing) is the user's to fix
            if (full := disk_full(e)) is None:
                raise
            click.echo(f"error: {full}", err=True)
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


def _says_waits(fn):
    """A command that reads an output says on stderr what its storage waits for, instead of waiting silently."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from hsextract.storage import log_on_stderr

        with log_on_stderr():
            return fn(*args, **kwargs)

    return wrapper


def _int_list(value):
    if value is None or isinstance(value, tuple):
        return value
    try:
        return tuple(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None


def _help(doc: str, default) -> str:
    text = " ".join(doc.replace("``", "").split())
    return text if default is None else f"{text} [default: {default}]"


def _config_option(f: dataclasses.Field, cls: type = RunConfig, required: tuple = REQUIRED) -> Callable:
    """The click option of one field of a config class: flag, type, choices and help from the field itself. Every
    option defaults to None, so that a value from --config is overridden only by an option actually given."""
    flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
    help = _help(config_field_docs(cls).get(f.name, ""), f.default)
    if f.name in required:  # not click's required=True: the --config file may give it
        help += " [required, here or in --config]"
    kind = str(f.type)
    if kind == "bool":
        return click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None, help=help)
    if f.metadata["choices"]:
        return click.option(flag, f.name, type=click.Choice(f.metadata["choices"]), default=None, help=help)
    if kind.startswith("tuple[str"):
        return click.option(flag, f.name, multiple=True, default=None, help=help)
    if kind.startswith("tuple[int, ...] | None"):
        return click.option(flag, f.name, callback=lambda _ctx, _p, v: _int_list(v), default=None, help=help)
    types = {"int": int, "int | None": int, "float": float, "float | None": float}
    return click.option(flag, f.name, type=types.get(kind, str), default=None, help=help)


def _no_tensor_parallel(ctx, param, value):
    if value is not None:
        raise click.UsageError(
            f"--tensor-parallel-size {value}: hsextract has no tensor parallelism; --shards N is data parallel "
            "(N workers, each a whole copy of the target on one GPU). A target too big for one GPU: "
            "docs/SCALING.md, 'GPU memory per shard' (an FP8 checkpoint holds half)."
        )


def config_options(*commands: str, cls: type = RunConfig, required: tuple = REQUIRED) -> Callable:
    """The fields of ``cls`` whose ``cli`` metadata is one of ``commands``, as click options, plus --config."""

    def decorate(fn):
        fields = [f for f in dataclasses.fields(cls) if f.metadata.get("cli") in commands]
        for f in reversed(fields):
            fn = _config_option(f, cls, required)(fn)
        if "job" in commands:  # vLLM's flag, given by habit: what hsextract does instead
            fn = click.option(
                "--tensor-parallel-size",
                "--tp",
                hidden=True,
                expose_value=False,
                callback=_no_tensor_parallel,
            )(fn)
        return click.option(
            "--config",
            "config_file",
            type=click.Path(dir_okay=False),
            help="YAML file of options (configs/).",
        )(fn)

    return decorate


def _build_config(**opts) -> RunConfig:
    values = load_yaml(opts.pop("config_file")) if opts.get("config_file") else {}
    opts.pop("config_file", None)
    # An option given no times (multiple=True gives ()) leaves the file's value.
    values.update({key: value for key, value in opts.items() if value is not None and value != ()})
    if "gpus" in values:
        values["gpus"] = _int_list(values["gpus"])
    defaulted = bool(values.get("output") and not values.get("run_dir"))
    if defaulted:
        node_rank = values.get("node_rank", 0) if values.get("nodes", 1) > 1 else None
        values["run_dir"] = str(default_run_dir(values["output"], node_rank))
    cfg = RunConfig(**values).with_model_resolved()
    if defaulted:  # said once the options hold: a refused command names no run dir
        click.echo(f"run dir: {cfg.run_dir} (from --output; rerun the same command here to resume)")
    if values.get("device", "auto") == "auto":
        from hsextract.devices import resolve_device

        click.echo(f"device: {cfg.device} ({resolve_device('auto')[1]})")
    return cfg


@click.group()
@click.version_option(package_name="hsextract")
def main():
    """Extract hidden states of chosen decoder layers of a target model, for drafter training."""
    install_redaction()  # this process's logs and tracebacks never show a credential; the workers do the same


@main.command()
@config_options("job", "run")
@click.option("--only-shards", help="Run only these shards, e.g. 2,3.")
@click.option(
    "--restart", is_flag=True, help="Discard the progress of a different previous plan in --run-dir."
)
@click.option("--yes", is_flag=True, help="With --restart: delete a finished output without asking.")
@click.option("--no-progress", is_flag=True, help="No progress bars (logs only).")
@_user_errors
def run(only_shards, restart, yes, no_progress, nodes, node_rank, **opts):
    """Extract hidden states; rerun the same command to resume after a crash."""
    from hsextract.run.cluster import node_place

    stop_on_signals()  # SIGTERM / SIGINT: workers stopped cleanly, and a word on how to resume
    from hsextract.run.job import run_job

    place = node_place(nodes, node_rank)
    cfg = _build_config(nodes=place.nodes, node_rank=place.rank, **opts)
    echo = steady_echo(f"hsextract status {cfg.run_dir}")  # `run | head -1` carries on
    if place.nodes > 1:
        first, last = cfg.local_shards[0], cfg.local_shards[-1]
        mine = f"shard {first}" if first == last else f"shards {first}..{last}"
        echo(f"{place.describe()}: {mine} of {cfg.total_shards}")
    if cfg.random_weights:
        raise HsextractError("random weights are for benchmarks only; `run` needs a real checkpoint")
    code = run_job(
        cfg,
        restart=restart,
        only_shards=_int_list(only_shards),
        show_progress=not no_progress,
        echo=echo,
        confirm=_confirm(yes),
    )
    sys.exit(code)


def _confirm(yes: bool):
    """How a destructive step is confirmed: --yes, else a question on a terminal, else not at all (refused)."""
    if yes:
        return lambda question: True
    if sys.stdin.isatty():
        return lambda question: click.confirm(question, default=False)
    return None


@main.command()
@config_options("regenerate", cls=RegenerateConfig, required=REGENERATE_REQUIRED)
@click.option(
    "--restart", is_flag=True, help="Delete what --output holds from other settings and start over."
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@_user_errors
def regenerate(restart, no_progress, config_file, **opts):
    """Answer the prompts of a data mix with the served target (OpenAI-compatible servers: vLLM, SGLang) and
    write the replies where `hsextract run --data` takes them; rerun the same command to resume."""
    from hsextract.regenerate.runner import regenerate as run_regenerate

    values = load_yaml(config_file, RegenerateConfig) if config_file else {}
    values.update({key: value for key, value in opts.items() if value is not None and value != ()})
    cfg = RegenerateConfig(**values)
    sys.exit(run_regenerate(cfg, restart=restart, show_progress=not no_progress, echo=click.echo))


@main.command("dry-run")
@config_options("job")
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
        result = dry_run(cfg, num_samples=num_samples, echo=lambda line: click.echo(line, err=True))
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
@_says_waits
def status(run_dir, as_json, s3_endpoint_url, serve, host, port):
    """Per-shard progress of a run, live or finished. Given a run dir: this node's shards with rates and states.
    Given an output (s3://bucket/prefix or a directory): every node's and shard's progress, from the output alone."""
    from hsextract.run.rundir import RunDir
    from hsextract.status.document import status_document
    from hsextract.status.table import run_table

    if "://" not in run_dir and not Path(run_dir).exists():
        raise HsextractError(
            f"the directory {run_dir} does not exist: give a run dir (runs/...) or an output"
        )
    if not RunDir(run_dir).is_run_dir() and _is_output(run_dir):
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
    click.echo(json.dumps(doc, indent=2) if as_json else run_table(doc))


def _is_output(target: str) -> bool:
    return "://" in target or (Path(target) / "hsextract").is_dir()


def _output_status(target: str, endpoint: str | None, as_json: bool) -> None:
    from hsextract.status.rows import output_status
    from hsextract.status.table import output_table
    from hsextract.storage import open_sink

    doc = output_status(open_sink(target, endpoint, retry_deadline_s=120, reading=True))
    click.echo(json.dumps(doc, indent=2) if as_json else output_table(doc))


@main.command()
@click.argument("output")
@click.option("--s3-endpoint-url", help="S3-compatible endpoint, for an s3:// OUTPUT.")
@_user_errors
@_says_waits
def finalize(output, s3_endpoint_url):
    """Write OUTPUT's manifest if every batch of the job is done; checks each batch in the output first."""
    from hsextract.run.launcher import finish_output
    from hsextract.storage import open_sink

    sink = open_sink(output, s3_endpoint_url, reading=True)
    if (absent := sink.missing_place()) is not None:
        raise HsextractError(absent)
    code, missing = finish_output(sink, echo=click.echo)
    sys.exit(code or (1 if missing else 0))  # 0 only with the manifest written


@main.command()
@click.argument("output")
@click.option("--s3-endpoint-url", help="S3-compatible endpoint (AWS_ENDPOINT_URL_S3 works too).")
@click.option(
    "--workers", type=click.IntRange(min=1), default=8, show_default=True, help="Files checked at once."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@_user_errors
@_says_waits
def verify(output, s3_endpoint_url, workers, as_json):
    """Check every file of a finished output against its manifest: size, CRC32, header and sample checksums.

    Prints each bad file with its problem and exits 1 if there is any."""
    from hsextract.output import verify_output

    report = verify_output(output, s3_endpoint_url, workers=workers)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for line in report.lines():
            click.echo(line)
        from hsextract.run.progress import format_bytes

        verdict = "all good" if report.ok else f"{len(report.bad)} bad"
        click.echo(f"verified {report.describe()} ({format_bytes(report.bytes)}) of {report.url}: {verdict}")
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("output")
@click.argument("dest")
@click.option(
    "--format",
    "fmt",
    required=True,
    type=click.Choice(
        [
            "specforge-dflash",
            "specforge-dflash2",
            "specforge-dspark",
            "specforge-eagle3",
            "speculators",
            "modelopt",
            "nemo-dspark",
        ]
    ),
    help="The trainer's offline layout (docs/EXPORT.md).",
)
@click.option(
    "--draft-vocab", type=int, help="Also write the trainer's draft-vocabulary mapping for N tokens."
)
@click.option(
    "--target-vocab-size", type=int, help="Target vocabulary size, for outputs whose manifest lacks it."
)
@click.option(
    "--num-proc",
    type=click.IntRange(min=1),
    help="Processes writing export files. [default: the cores this process may use, at most 8]",
)
@click.option(
    "--s3-endpoint-url", help="S3-compatible endpoint for OUTPUT and DEST (AWS_ENDPOINT_URL_S3 works too)."
)
@click.option(
    "--index-only",
    is_flag=True,
    help="speculators: only the table (input_ids, loss_mask, seq_len), no states; train with "
    "hsextract.training.speculators.OutputTransfer reading them from OUTPUT (docs/TRAINING.md).",
)
@click.option(
    "--layers",
    help="The stored layers to export, in this order: ids (5,19,33,47,61) or a preset the output records "
    "(dflash2). Default: the format's own preset of an output of several, else every captured layer.",
)
@click.option(
    "--seq-length", type=int, help="nemo-dspark: every row padded to this length (default: --max-length)."
)
@click.option("--shard-size", type=int, help="nemo-dspark: samples per shard (default 16).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@_user_errors
@_says_waits
def export(
    output,
    dest,
    fmt,
    draft_vocab,
    target_vocab_size,
    num_proc,
    s3_endpoint_url,
    index_only,
    layers,
    seq_length,
    shard_size,
    no_progress,
):
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
        index_only=index_only,
        layers=layers,
        seq_length=seq_length,
        shard_size=shard_size,
        show_progress=not no_progress,
        echo=click.echo,
    )


@main.command()
@click.option("--model", required=True, help="Local checkpoint directory or Hub id (org/name).")
@click.option(
    "--layers", default="dflash,dflash2,dspark,eagle3", show_default=True, help="Presets (a union) or ids."
)
@click.option("--revision", help="With a Hub id: the branch, tag or commit.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_user_errors
def layers(model, layers, revision, as_json):
    """The layer ids each preset picks for MODEL, in hsextract's count and vLLM's, from its config.json alone."""
    from hsextract.model.layer_map import format_layer_map, layer_map

    result = layer_map(model, layers, revision)
    click.echo(json.dumps(result, indent=2) if as_json else format_layer_map(result))


@main.command()
@click.option("--root", default="demo", show_default=True, help="Where the tiny model, data and output go.")
@click.option("--shards", default=2, show_default=True)
@click.option("--conversations", default=300, show_default=True)
@_user_errors
def demo(root, shards, conversations):
    """The embedded default: build a tiny random qwen3_5 model and sample conversations, run on CPU, read back."""
    stop_on_signals()
    from hsextract.demo import build_demo, demo_config, job_lines
    from hsextract.output import open_output
    from hsextract.run.launcher import launch
    from hsextract.run.preflight import prepare_run

    root = Path(root).resolve()
    click.echo(f"building the tiny model and {conversations} conversations under {root}")
    model_dir, data = build_demo(root, conversations)
    cfg = demo_config(root, model_dir, data, shards)
    click.echo(job_lines(cfg))
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


def entry() -> None:
    """The console script: the CLI, then an exit that skips the interpreter's teardown (run/procs.py says why)."""
    from hsextract.run.procs import exit_now

    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):  # what SystemExit itself would do with a message
        print(code, file=sys.stderr)
    exit_now(code if isinstance(code, int) else int(code is not None))


if __name__ == "__main__":
    entry()
