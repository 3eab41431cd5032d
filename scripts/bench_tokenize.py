"""Rows/s of tokenizing with 1 process (in the caller) vs N spawned ones, to pick ``--num-proc``'s default.

Builds the demo tokenizer (byte-level BPE, ChatML template with tools and ``<think>``) and conversations of
realistic length for drafter training (1-6 turns, assistant answers of ~200 words median, a fifth with tool
calls, a third with reasoning), then times ``load_samples`` (no cache) on the first ``n`` rows for each ``n`` and
each process count. Each timing is the full call a run makes: the spawned pool's start-up (every child unpickles
the tokenizer, importing transformers) is part of it.

    python scripts/bench_tokenize.py --rows 100,300,1000,3000 --procs 1,2,4 --json docs/tokenize-bench.json

Prints one line per (rows, procs) and, for each N > 1, a fit ``t = start + rows / rate`` and the crossover (rows
and MB of JSONL) above which N processes beat one.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="100,300,1000,3000")
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--json", help="write the raw timings here")
    args = ap.parse_args()
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
