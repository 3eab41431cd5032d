"""Prepare a run (every check before any weight loads), start one worker process per shard, finish the output.

``prepare_run`` does the cheap, fallible work first so bad input fails in seconds, not after loading 54 GB of
weights: the model config and layer ids, the output (a probe object), the staging directory's free space, the
dataset (tokenized in parallel, cached in the run dir, bad rows counted in ``data_report.json``) and the plan. A
run dir that already holds a plan is resumed only if the new plan is identical; otherwise the message says what
changed, and ``--restart`` starts over.

``launch`` starts one worker process per shard (``hsextract.worker.main`` with RUN_DIR SHARD) with
``CUDA_VISIBLE_DEVICES`` set before torch is imported there, and a parent-death signal so a killed launcher takes
its workers with it. It draws a progress bar per shard from the progress files, waits for every worker, and exits
non-zero naming each failed shard and its log. When every planned batch has a marker it writes ``manifest.json``
to the output, last: an output with a manifest is complete.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import __version__
from .capture import CONVENTION, layer_types, load_model_config, resolve_layer_ids
from .config import DTYPE_BYTES, RunConfig
from .data import DataReport, TokenizedSamples, data_fingerprint, load_samples, tokenizer_fingerprint
from .errors import HsextractError
from .plan import Plan, fingerprint_changes, make_plan
from .procs import die_with_parent
from .progress import ShardProgress, done_keys, log_path, markers_dir, progress_path, shard_status
from .storage import open_sink, preflight
from .writer import estimate_file_bytes

TOKENS_FILE = "tokens.safetensors"


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise HsextractError(
            f"--model {model}: could not load its tokenizer ({str(e).splitlines()[0]})"
        ) from None
    if tok.pad_token_id is None:
        # Padding is on the right and masked out; any id works, the states of valid tokens never see it.
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    return tok


def _model_identity(model: str, config) -> dict:
    config_file = Path(model) / "config.json"
    digest = ""
    if config_file.exists():
        import hashlib

        digest = hashlib.sha256(config_file.read_bytes()).hexdigest()[:16]
    return {
        "model": model,
        "model_revision": getattr(config, "_commit_hash", None) or "",
        "model_config_hash": digest,
    }


def check_staging(cfg: RunConfig, need_bytes: int) -> None:
    """The staging directory must be writable and hold at least one batch file, else fail before any work."""
    staging = cfg.staging_dir
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


def prepare_run(
    cfg: RunConfig, *, restart: bool = False, echo=print, show_progress: bool = True
) -> tuple[Plan, dict]:
    """Validate everything, tokenize, plan; write config.json, run.json and plan.json. Loads no weights."""
    run_dir = Path(cfg.run_dir)
    config, text, num_layers = load_model_config(cfg.model)
    layer_ids = resolve_layer_ids(cfg.layers, num_layers)
    hidden = text.hidden_size
    itemsize = DTYPE_BYTES[cfg.dtype]
    preflight(cfg.output, cfg.s3_endpoint_url)
    check_staging(cfg, estimate_file_bytes(cfg.max_tokens_per_batch, 1, len(layer_ids), hidden, itemsize))

    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg.model)
    samples, report = load_samples(
        cfg.data,
        tokenizer,
        max_length=cfg.max_length,
        too_long=cfg.too_long,
        num_proc=cfg.num_proc,
        cache_dir=run_dir / "cache",
        progress=show_progress,
    )
    echo(f"data: {report.summary()}")
    samples, duplicate_ids = _unique_sample_ids(samples, echo)

    tok_fp = tokenizer_fingerprint(tokenizer)
    fingerprint = {
        "data": data_fingerprint(cfg.data),
        **tok_fp,
        **_model_identity(cfg.model, config),
        "layer_ids": list(layer_ids),
        "dtype": cfg.dtype,
        "max_length": cfg.max_length,
        "too_long": cfg.too_long,
        "max_tokens_per_batch": cfg.max_tokens_per_batch,
        "max_rows": cfg.max_rows,
        "random_weights": cfg.random_weights,
    }
    plan = make_plan(
        samples.lengths.tolist(),
        max_tokens_per_batch=cfg.max_tokens_per_batch,
        max_rows=cfg.max_rows,
        shards=cfg.shards,
        fingerprint=fingerprint,
    )
    plan_file = run_dir / "plan.json"
    if not plan_file.exists():
        _refuse_foreign_output(cfg, plan)
    if plan_file.exists():
        old = Plan.load(plan_file)
        if old.plan_hash != plan.plan_hash:
            if not restart:
                changes = fingerprint_changes(old.fingerprint, plan.fingerprint)
                if old.shards != plan.shards:
                    changes.append(f"shards: {old.shards} -> {plan.shards}")
                raise HsextractError(
                    f"run dir {run_dir} holds a different plan; resuming would mix two jobs. What changed:\n  "
                    + "\n  ".join(changes or ["the batches (same settings, different samples)"])
                    + "\nRerun with the original settings to resume, or add --restart to start over."
                )
            _reset_run(run_dir, cfg, old, plan)
            echo(
                f"--restart: cleared markers, progress and staging of the previous plan in {run_dir}, and its "
                f"manifest and batch files in {cfg.output}"
            )

    # Written only once the plan is accepted: a refused rerun leaves the run dir as it was.
    (run_dir / "data_report.json").write_text(
        json.dumps({**report.to_json(), "duplicate_ids_renamed": duplicate_ids}, indent=2)
    )
    samples.save(run_dir / TOKENS_FILE)
    meta = {
        "layer_ids": list(layer_ids),
        "num_layers": num_layers,
        "hidden_size": hidden,
        "pad_token_id": tokenizer.pad_token_id,
        "tokens_file": TOKENS_FILE,
        "plan_hash": plan.plan_hash,
        "layer_types": [layer_types(text)[k] for k in layer_ids],
        "file_metadata": {
            "layer_ids": json.dumps(list(layer_ids)),
            "layer_convention": CONVENTION,
            "hf_output_hidden_states_index": json.dumps([k + 1 for k in layer_ids]),
            "pre_final_norm": "true",
            "model": cfg.model,
            "model_revision": fingerprint["model_revision"],
            "model_config_hash": fingerprint["model_config_hash"],
            "dtype": cfg.dtype,
            "hidden_size": str(hidden),
            "tokenizer_hash": tok_fp["tokenizer_hash"],
            "chat_template_hash": tok_fp["chat_template_hash"],
            "plan_hash": plan.plan_hash,
            "hsextract_version": __version__,
        },
    }
    cfg.save(run_dir / "config.json")
    (run_dir / "run.json").write_text(json.dumps(meta, indent=2))
    plan.save(plan_file)
    echo(f"plan: {plan.summary()}")
    return plan, meta


def _refuse_foreign_output(cfg: RunConfig, plan: Plan) -> None:
    """A new run dir must not write into an output that holds another run's batches: keys would collide and the
    result would mix two jobs' states without a trace."""
    sink = open_sink(cfg.output, cfg.s3_endpoint_url)
    if sink.exists("manifest.json"):
        other = json.loads(sink.get_bytes("manifest.json")).get("plan_hash")
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


def _unique_sample_ids(samples: TokenizedSamples, echo) -> tuple[TokenizedSamples, int]:
    """Rows sharing an id are all kept; repeats get ``#2``, ``#3``... so the reader can look each one up."""
    seen: dict[str, int] = {}
    ids, renamed = [], 0
    for sid in samples.sample_ids:
        n = seen.get(sid, 0) + 1
        seen[sid] = n
        if n > 1:
            renamed += 1
            sid = f"{sid}#{n}"
            while sid in seen:
                sid += "'"
            seen[sid] = 1
        ids.append(sid)
    if not renamed:
        return samples, 0
    echo(
        f"warning: {renamed} row(s) repeat an earlier row's id; renamed to id#2, id#3, ... (see data_report.json)"
    )
    fixed = TokenizedSamples(
        sample_ids=ids, input_ids=samples.input_ids, loss_mask=samples.loss_mask, offsets=samples.offsets
    )
    return fixed, renamed


def _reset_run(run_dir: Path, cfg: RunConfig, old: Plan, new: Plan) -> None:
    # The manifest goes first: from here on the output is no longer the old plan's, and until the new manifest is
    # written it is not complete. Batch files the new plan does not overwrite would be left over from the old one.
    sink = open_sink(cfg.output, cfg.s3_endpoint_url)
    sink.delete("manifest.json")
    for key in {b.key for b in old.batches} - {b.key for b in new.batches}:
        sink.delete(key)
    for sub in ("markers", "progress"):
        shutil.rmtree(run_dir / sub, ignore_errors=True)
    shutil.rmtree(cfg.staging_dir, ignore_errors=True)
    (run_dir / "COMPLETE").unlink(missing_ok=True)


def _die_with_launcher():
    """``preexec_fn`` for a child of this launcher: it dies with the launcher, even one killed mid-fork."""
    return functools.partial(die_with_parent, os.getpid())


def start_worker(cfg: RunConfig, shard: int) -> subprocess.Popen:
    run_dir = Path(cfg.run_dir)
    env = dict(os.environ)
    if cfg.device == "cuda":
        gpus = cfg.gpus or tuple(range(cfg.shards))
        env["CUDA_VISIBLE_DEVICES"] = str(gpus[shard])
    else:
        # CPU shards share the host's cores. Each torch would start one OpenMP thread per core, and more threads
        # than cores make every small op wait on spinning threads (measured: a 300-token forward of the tiny model
        # 0.02 s with 1 thread, 0.05-2.5 s with 2 threads per process on 2 cores).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // cfg.shards)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # One Triton cache for every process of the run: kernels compiled once (by the warm-up) serve all shards.
    env.setdefault("TRITON_CACHE_DIR", str(run_dir / "triton-cache"))
    out = log_path(run_dir, shard, "stderr")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not `-m hsextract.worker`: the worker starts its uploader with `spawn`, which re-imports the parent's __main__
    # module in the child, and that module imports torch. A `-c` program leaves the child nothing to re-import.
    entry = "import sys; from hsextract.worker import main; sys.exit(main())"
    with open(out, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-c", entry, str(run_dir), str(shard)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_launcher(),
        )


def prewarm(cfg: RunConfig, echo=print) -> None:
    """Compile flash-linear-attention's kernels once into the shared Triton cache before the shards start."""
    from .warmup import fla_available

    if not fla_available():
        echo(
            "flash-linear-attention is not installed: Gated-DeltaNet layers run the slow torch path "
            "(pip install -e .[gpu])"
        )
        return
    run_dir = Path(cfg.run_dir)
    env = dict(os.environ)
    env.setdefault("TRITON_CACHE_DIR", str(run_dir / "triton-cache"))
    env["CUDA_VISIBLE_DEVICES"] = str((cfg.gpus or (0,))[0])
    t0 = time.time()
    echo("pre-warming flash-linear-attention kernels into the shared Triton cache ...")
    log_path(run_dir, 0).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path(run_dir, 0, "warmup"), "ab") as f:
        r = subprocess.run(
            [sys.executable, "-m", "hsextract.warmup", str(run_dir)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_launcher(),
        )
    if r.returncode == 0:
        echo(f"kernels warm in {time.time() - t0:.0f} s")
    else:
        echo(
            f"warm-up failed (exit {r.returncode}, see {log_path(run_dir, 0, 'warmup')}); shards compile themselves"
        )


def launch(cfg: RunConfig, plan: Plan, *, only_shards=None, show_progress: bool = True, echo=print) -> int:
    """Run the shards to completion; returns the process exit code."""
    run_dir = Path(cfg.run_dir)
    shards = sorted(only_shards) if only_shards else list(range(cfg.shards))
    bad = [s for s in shards if not 0 <= s < cfg.shards]
    if bad:
        raise HsextractError(f"--only-shards {bad}: this run has shards 0..{cfg.shards - 1}")
    done = done_keys(run_dir)
    todo = [s for s in shards if any(b.key not in done for b in plan.for_shard(s))]
    if len(todo) < len(shards):
        echo(f"shards already complete: {sorted(set(shards) - set(todo))}")
    if todo and cfg.device == "cuda" and cfg.prewarm:
        prewarm(cfg, echo=echo)
    procs = {s: start_worker(cfg, s) for s in todo}
    bars = _Bars(run_dir, plan, todo, enabled=show_progress)
    failed: dict[int, int] = {}
    try:
        while procs:
            for s, p in list(procs.items()):
                rc = p.poll()
                if rc is not None:
                    del procs[s]
                    if rc != 0:
                        failed[s] = rc
            bars.update()
            time.sleep(0.25)
    finally:
        bars.close()
    for s, rc in sorted(failed.items()):
        prog = ShardProgress.load(run_dir, s)
        if prog and prog.state == "failed" and prog.error:
            why = f": {prog.error}"
        else:  # died before it could record why (or refused to touch the progress file): its last words
            why = _last_line(log_path(run_dir, s, "stderr"))
            why = f": {why}" if why else ""
        echo(
            f"shard {s} failed ({_exit_reason(rc)}){why}\n  log: {log_path(run_dir, s)}\n  output: {log_path(run_dir, s, 'stderr')}"
        )
    if failed:
        echo("Rerun the same command to resume: finished batches are kept.")
        return 1
    return finalize(cfg, plan, echo=echo)


def _last_line(path: Path) -> str:
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


def finalize(cfg: RunConfig, plan: Plan, echo=print) -> int:
    """Write the manifest once every planned batch is durable. The manifest goes last."""
    run_dir = Path(cfg.run_dir)
    done = done_keys(run_dir)
    missing = [b.key for b in plan.batches if b.key not in done]
    if missing:
        echo(
            f"{len(missing)} of {len(plan.batches)} batches still to do (other shards); no manifest written yet"
        )
        return 0
    meta = json.loads((run_dir / "run.json").read_text())
    samples = TokenizedSamples.load(run_dir / meta["tokens_file"])
    report = json.loads((run_dir / "data_report.json").read_text())
    manifest = {
        "format": "hsextract-output",
        "format_version": 1,
        "hsextract_version": __version__,
        "layer_ids": meta["layer_ids"],
        "layer_convention": CONVENTION,
        "layer_types": meta["layer_types"],
        "hidden_size": meta["hidden_size"],
        "dtype": cfg.dtype,
        "plan_hash": plan.plan_hash,
        "fingerprint": plan.fingerprint,
        "num_samples": plan.num_samples,
        "num_tokens": plan.num_tokens,
        "data_report": report,
        "batches": [
            {
                "key": b.key,
                "batch_id": b.batch_id,
                "shard": b.shard,
                "num_tokens": b.num_tokens,
                "sample_ids": [samples.sample_ids[i] for i in b.sample_indices],
            }
            for b in plan.batches
        ],
    }
    sink = open_sink(cfg.output, cfg.s3_endpoint_url)
    sink.put_bytes("manifest.json", json.dumps(manifest).encode())
    (run_dir / "COMPLETE").write_text(plan.plan_hash)
    echo(
        f"done: {plan.num_samples} samples, {plan.num_tokens} tokens in {len(plan.batches)} batch files at {cfg.output}"
    )
    return 0


class _Bars:
    """One tqdm bar per shard, fed from the progress files the workers write."""

    def __init__(self, run_dir: Path, plan: Plan, shards, enabled: bool):
        self.run_dir, self.shards, self.bars = run_dir, shards, {}
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
            )
        self.seen = {s: (0, "") for s in shards}

    def update(self) -> None:
        for s, bar in self.bars.items():
            p = ShardProgress.load(self.run_dir, s)
            if p is None or (p.tokens_done, p.state) == self.seen[s]:
                continue
            self.seen[s] = (p.tokens_done, p.state)
            bar.set_postfix_str(f"{p.state} {p.tokens_per_s:,.0f} tok/s", refresh=False)
            bar.update(p.tokens_done - bar.n)

    def close(self) -> None:
        self.update()
        for bar in self.bars.values():
            bar.close()


__all__ = ["prepare_run", "launch", "finalize", "shard_status", "progress_path", "markers_dir", "DataReport"]
