"""Rows/s of tokenizing with 1 process (in the caller) vs N spawned ones, to pick ``--num-proc``'s default.

Builds the demo tokenizer (byte-level BPE, ChatML template with tools and ``<think>``) and conversations of
realistic length for drafter training (1-6 turns, assistant answers of ~200 words median, a fifth with tool
calls, a third with reasoning), then times ``load_samples`` (no cache) on the first ``n`` rows for each ``n`` and
each process count. Each timing is the full call a run makes: the spawned pool's start-up (every child unpickles
the tokenizer, importing transformers) is part of it.

    python scripts/bench_tokenize.py --rows 100,300,1000,3000 --procs 1,2,4 --json docs/tokenize-bench.json

Prints one line per (rows, procs) and, for each N > 1, a fit ``t = start + rows / rate`` and the crossover (rows
and MB of JSONL) above which N processes beat one.

``--mix ROWS[,ROWS...]`` measures a large mix instead: for each total it writes four sources of about equal size
(a glob of two JSONL shards, one gzipped; a ``.jsonl.zst`` file; a Hub-layout folder of two Parquet shards; plain
``text`` rows), streamed to disk, then tokenizes them in a fresh process (``--num-proc 1``) and reports rows/s and
that process's peak RSS (``ru_maxrss``) next to its RSS before tokenizing. ``--single`` does the same over one
JSONL file holding the same rows, with ``load_samples(path)`` only, so that ``--child-src OLD/src`` measures an
older checkout's code on the same rows:

    python scripts/bench_tokenize.py --mix 50000,200000 --json mix.json

``--huge MB`` times one JSONL file of two rows of MB megabytes each (plain ``text``, and a chat row whose
assistant answer is that text) cut to ``--max-length`` (also with ``--child-src``):

    python scripts/bench_tokenize.py --huge 50 --max-length 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hsextract.demo import TOOLS, _sentence, build_tokenizer, make_conversations, write_jsonl  # noqa: E402
from hsextract.prepare.tokenize import load_samples  # noqa: E402


def long_conversations(n: int, seed: int = 0) -> list[dict]:
    """Chat rows of the lengths drafter training data has (ShareGPT / UltraChat-like: ~1-3k tokens median)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages: list[dict] = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": _sentence(rng, rng.randint(10, 60))})
        use_tools = rng.random() < 0.2
        for _ in range(rng.choice([1, 1, 2, 2, 3, 4, 6])):
            messages.append({"role": "user", "content": _sentence(rng, int(rng.lognormvariate(3.5, 0.8)))})
            answer = _sentence(rng, int(rng.lognormvariate(5.3, 0.7)))
            if rng.random() < 0.3:
                answer = f"<think>\n{_sentence(rng, int(rng.lognormvariate(5.0, 0.7)))}\n</think>\n\n{answer}"
            if use_tools and rng.random() < 0.6:
                call = {"function": {"name": "get_weather", "arguments": {"city": _sentence(rng, 1)}}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                messages.append({"role": "tool", "content": _sentence(rng, rng.randint(10, 80))})
            messages.append({"role": "assistant", "content": answer})
        row: dict = {"id": f"long-{i:05d}", "messages": messages}
        if use_tools:
            row["tools"] = TOOLS
        rows.append(row)
    return rows


def _mix_row(i: int, rng: random.Random) -> dict:
    """A short chat row (1-2 turns, ~100 tokens), the shape of instruction-following and tool-call data."""
    messages = []
    for _ in range(rng.choice([1, 1, 2])):
        messages.append({"role": "user", "content": _sentence(rng, rng.randint(4, 20))})
        messages.append({"role": "assistant", "content": _sentence(rng, rng.randint(8, 60))})
    return {"id": f"r{i}", "messages": messages}


def write_mix(root: Path, total: int, seed: int = 0) -> list[str]:
    """Four sources of ``total // 4`` rows each, written row by row; returns their specs."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng = random.Random(seed)
    quarter = total // 4
    (root / "convs").mkdir(parents=True)
    (root / "hub" / "data").mkdir(parents=True)
    halves = [quarter // 2, quarter - quarter // 2]
    with open(root / "convs" / "part-0.jsonl", "w") as f:
        f.writelines(json.dumps(_mix_row(i, rng)) + "\n" for i in range(halves[0]))
    with gzip.open(root / "convs" / "part-1.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(_mix_row(i, rng)) + "\n" for i in range(halves[1]))
    with open(root / "tools.jsonl.zst", "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as f:
        for i in range(quarter):
            f.write((json.dumps(_mix_row(i, rng)) + "\n").encode())
    for k, n in enumerate(halves):
        rows = [_mix_row(i, rng) for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), root / "hub" / "data" / f"train-0000{k}-of-00002.parquet")
    (root / "hub" / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/*.parquet\n---\n"
    )
    with open(root / "code.jsonl", "w") as f:
        for i in range(quarter):
            f.write(json.dumps({"id": f"c{i}", "text": _sentence(rng, rng.randint(20, 120))}) + "\n")
    return [
        f"{root / 'convs' / 'part-*'}?name=convs",
        f"{root / 'tools.jsonl.zst'}?name=tools",
        f"{root / 'hub'}?name=hub",
        f"{root / 'code.jsonl'}?name=code",
    ]


def write_single(root: Path, specs: list[str]) -> Path:
    """The mix's rows in one JSONL file (for a checkout that reads one file only)."""
    from hsextract.prepare.sources import resolve_sources

    path = root / "single.jsonl"
    with open(path, "w") as f:
        for _, _, row in resolve_sources(specs, cache_dir=root / "cache").rows():
            f.write(json.dumps(row) + "\n")
    return path


def measure(tok_dir: str, data: list[str], max_length: int) -> dict:
    """In this (fresh) process: tokenize ``data``; rows/s and peak RSS."""
    import resource

    import datasets  # noqa: F401  (imported first: the RSS before tokenizing then counts the libraries)
    import pyarrow.parquet  # noqa: F401
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    rss_before = _rss_mb()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    source = data[0] if len(data) == 1 and "?" not in data[0] else data
    samples, report = load_samples(source, tokenizer, max_length=max_length, num_proc=1, progress=False)
    dt = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    peak = cpu1.ru_maxrss / 1024
    return {
        "rows": report.rows,
        "seconds": dt,
        "cpu_seconds": cpu,
        "rows_per_s": report.rows / dt,
        "rows_per_cpu_s": report.rows / cpu,
        "tokens": report.tokens,
        "rss_before_mb": rss_before,
        "peak_rss_mb": peak,
    }


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure_in_child(tok_dir: Path, data: list[str], max_length: int, child_src: str | None) -> dict:
    """``measure`` in a fresh process, with ``child_src`` (another checkout's src) first on its path if given."""
    import subprocess

    env = dict(os.environ, **({"PYTHONPATH": child_src} if child_src else {}))
    out = subprocess.run(
        [sys.executable, __file__, "--measure", str(tok_dir), "--max-length", str(max_length), *data],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_huge(mb: float, max_length: int, child_src: str | None) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-huge-") as tmp:
        tmp = Path(tmp)
        build_tokenizer(tmp / "tok", corpus=make_conversations(300, seed=1))
        rng = random.Random(0)
        chunk = _sentence(rng, 200_000) + "\n"
        text = (chunk * (int(mb * 1e6) // len(chunk) + 1))[: int(mb * 1e6)]
        path = tmp / "huge.jsonl"
        with open(path, "w") as f:
            f.write(json.dumps({"id": "text", "text": text}) + "\n")
            messages = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": text}]
            f.write(json.dumps({"id": "chat", "messages": messages}) + "\n")
        result = measure_in_child(tmp / "tok", [str(path)], max_length, child_src)
    print(
        f"2 rows of {mb:g} MB cut to {max_length} tokens: {result['seconds']:.1f} s "
        f"({result['cpu_seconds']:.1f} CPU-s), peak RSS {result['peak_rss_mb']:.0f} MB"
        + (f" [{child_src}]" if child_src else "")
    )
    return 0


def run_mix(
    sizes: list[int], max_length: int, single: bool, json_path: str | None, child_src: str | None
) -> int:
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-mix-") as tmp:
        tmp = Path(tmp)
        build_tokenizer(tmp / "tok", corpus=make_conversations(300, seed=1))
        for n in sizes:
            root = tmp / f"mix-{n}"
            specs = write_mix(root, n)
            data = [str(write_single(root, specs))] if single else specs
            result = {
                "total": n,
                "single_file": single,
                "child_src": child_src,
                **measure_in_child(tmp / "tok", data, max_length, child_src),
            }
            results.append(result)
            print(
                f"{'one file' if single else 'mix of 4'} {result['rows']:>8} rows  {result['seconds']:7.1f} s  "
                f"{result['rows_per_s']:7.0f} rows/s  {result['rows_per_cpu_s']:7.0f} rows/CPU-s  "
                f"{result['tokens'] / result['cpu_seconds']:9,.0f} tok/CPU-s  "
                f"RSS before {result['rss_before_mb']:.0f} MB, peak {result['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="100,300,1000,3000")
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--json", help="write the raw timings here")
    ap.add_argument("--mix", help="total rows of a four-source mix, comma-separated")
    ap.add_argument("--single", action="store_true", help="with --mix: the same rows as one JSONL file")
    ap.add_argument("--huge", type=float, help="MB of each of two one-line rows, cut to --max-length")
    ap.add_argument(
        "--child-src", help="with --mix or --huge: PYTHONPATH of the measuring process (another checkout)"
    )
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("data", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.data, args.max_length)))
        return 0
    if args.huge:
        return run_huge(args.huge, args.max_length, args.child_src)
    if args.mix:
        return run_mix(
            [int(x) for x in args.mix.split(",")], args.max_length, args.single, args.json, args.child_src
        )
    sizes = [int(x) for x in args.rows.split(",")]
    procs = [int(x) for x in args.procs.split(",")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    with tempfile.TemporaryDirectory(prefix="bench-tok-") as tmp:
        tmp = Path(tmp)
        tokenizer = build_tokenizer(tmp / "tok", corpus=make_conversations(300, seed=1))
        rows = long_conversations(max(sizes), seed=3)
        results = []
        for n in sizes:
            path = write_jsonl(rows[:n], tmp / f"rows-{n}.jsonl")
            mb = path.stat().st_size / 1e6
            for p in procs:
                t0 = time.perf_counter()
                samples, report = load_samples(
                    path, tokenizer, max_length=args.max_length, num_proc=p, progress=False
                )
                dt = time.perf_counter() - t0
                tokens = int(samples.lengths.sum())
                results.append({"rows": n, "mb": mb, "procs": p, "seconds": dt, "tokens": tokens})
                print(
                    f"rows {n:>5}  {mb:6.2f} MB  procs {p}  {dt:7.2f} s  {n / dt:8.1f} rows/s  "
                    f"{tokens / dt:10,.0f} tok/s  (mean {tokens / n:,.0f} tokens/row)",
                    flush=True,
                )

    # t(rows) = start + rows / rate, least squares per process count
    fits = {}
    for p in procs:
        pts = [(r["rows"], r["seconds"]) for r in results if r["procs"] == p]
        if len(pts) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        fits[p] = {"start_s": my - slope * mx, "rows_per_s": 1 / slope}
        print(f"procs {p}: start {fits[p]['start_s']:.2f} s, {fits[p]['rows_per_s']:.1f} rows/s")
    bytes_per_row = sum(r["mb"] for r in results if r["procs"] == procs[0]) * 1e6 / sum(sizes)
    for p, fit in fits.items():
        if p == 1 or 1 not in fits:
            continue
        one = fits[1]
        gain = 1 / one["rows_per_s"] - 1 / fit["rows_per_s"]
        if gain <= 0:
            print(f"procs {p}: never faster than 1 on this machine ({cores} cores)")
            fit["crossover_rows"] = None
            continue
        rows_x = (fit["start_s"] - one["start_s"]) / gain
        fit["crossover_rows"] = rows_x
        print(
            f"procs {p}: faster than 1 above {rows_x:,.0f} rows (~{rows_x * bytes_per_row / 1e6:.1f} MB of JSONL) "
            f"on {cores} cores"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"cores": cores, "bytes_per_row": bytes_per_row, "results": results, "fits": fits}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
