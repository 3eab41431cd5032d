"""What opening a large finished output costs a reader and a trainer, before and after the sample index: synthetic
outputs of 500 and 4,800 batch files (~190 samples a batch: ~914k samples at 4,800; tiny states, a few tokens a
sample: only the metadata paths are measured), local and on an S3 server on loopback (tests/support/s3server.py).

For each output and each code tree (``--before``: another checkout's ``src``, e.g. main's; ``after``: this one), a
fresh process measures, one step after another:

- ``open_output`` seconds (manifest read and checked), and the CPU seconds of this and the next two steps (what a
  shared machine's load does not inflate);
- ``status`` seconds (``hsextract status OUTPUT``'s document: ``status.rows.output_status``);
- ``dataset`` seconds of ``StatesDataset(output, "specforge-dflash")`` and ``first item`` seconds from before it to
  the first item out of a ``DataLoader`` with ``--workers`` workers (fork, Linux's default);
- ``worker MB``: the memory each of those workers holds privately (anonymous pages, from /proc/PID/smaps) once it
  has served its first item, less what a worker of a trivial dataset holds under the same DataLoader: the
  dataset's own cost per worker (mapped files and the shared memory of the states sent are shared, not counted);
- ``pickle MB``: what the dataset pickles to (what a spawn or forkserver worker would receive);
- on S3, the requests each step made (the server's own log), per batch file.

The outputs are written once with this tree's code (they carry the index; the code before ignores it) under
``--dir`` and reused. Step timings on a shared machine move with its load: compare the columns of one run.

    python scripts/bench_scale_read.py --before /work/main/src            # 500 and 4,800 batches, local and S3
    python scripts/bench_scale_read.py --before /work/main/src --batches 500 --no-s3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "specforge-dflash"


# -- in the measuring process ---------------------------------------------------------------------------------------
def private_anon_mb(pid: int) -> float:
    """Private pages of anonymous mappings (heap, malloc arenas): what a process holds that no other shares."""
    total, anon = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line: address range, ..., path
                parts = line.split()
                anon = len(parts) < 6 or parts[5].startswith("[heap") or parts[5].startswith("[anon")
            elif anon and first in ("Private_Clean:", "Private_Dirty:"):
                total += int(line.split()[1])
    return total / 1024


def worker_memory(loader, items: int) -> float:
    """Mean private anonymous MB of the loader's workers after ``items`` items (one from each worker)."""
    import psutil

    it = iter(loader)
    for _ in range(items):
        next(it)
    time.sleep(1.0)  # the workers fill their prefetch: each has read past its first item
    workers = psutil.Process().children()
    mb = sum(private_anon_mb(p.pid) for p in workers) / max(1, len(workers))
    del it
    return mb


class Trivial:
    """A dataset that holds nothing: the baseline of a worker's memory."""

    def __iter__(self):
        import torch

        while True:
            yield {"x": torch.zeros(4)}


def step(name: str, values: dict, s3: bool) -> None:
    """Report a step; with S3, wait for the parent to count its requests before the next step starts."""
    print(json.dumps({"step": name, **values}), flush=True)
    if s3:
        sys.stdin.readline()


def measure(output: str, endpoint: str | None, workers: int) -> None:
    import pickle

    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from hsextract.output import open_output
    from hsextract.status.rows import output_status
    from hsextract.storage import open_sink
    from hsextract.training import StatesDataset

    s3 = endpoint is not None
    step("start", {}, s3)
    t, cpu = time.perf_counter(), time.process_time()
    out = open_output(output, endpoint)
    step("open_output", {"s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}, s3)
    del out
    t, cpu = time.perf_counter(), time.process_time()
    output_status(open_sink(output, endpoint))
    step("status", {"s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}, s3)
    t, cpu = time.perf_counter(), time.process_time()
    data = StatesDataset(output, SCHEMA, endpoint_url=endpoint, batch_size=1)
    made = time.perf_counter() - t
    values = {"s": made, "cpu_s": time.process_time() - cpu, "pickle_mb": len(pickle.dumps(data)) / 1e6}
    step("dataset", values, s3)
    loader = DataLoader(data, batch_size=None, num_workers=workers)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t
    del it
    step("first_item", {"s": first}, s3)
    mb = worker_memory(DataLoader(data, batch_size=None, num_workers=workers), workers)

    class Empty(Trivial, IterableDataset):
        pass

    base = worker_memory(DataLoader(Empty(), batch_size=None, num_workers=workers), workers)
    step("memory", {"worker_mb": mb - base, "trivial_worker_mb": base}, s3)
    del torch


# -- in the driving process -----------------------------------------------------------------------------------------
def make_outputs(args, sizes: list[int]) -> dict[int, Path]:
    sys.path[:0] = [
        str(ROOT / "src"),
        str(ROOT / "tests"),
    ]  # written by this tree's code, whatever is installed
    from support.synthetic import make_output

    made = {}
    for n in sizes:
        path = Path(args.dir) / f"synthetic-{n}"
        if not (path / "manifest.json").exists():
            t = time.perf_counter()
            make_output(str(path), n)
            print(f"# wrote {path} in {time.perf_counter() - t:.0f} s", flush=True)
        made[n] = path
    return made


def upload(endpoint, bucket: str, prefix: str, root: Path) -> None:
    client = endpoint.client()
    files = [p for p in root.rglob("*") if p.is_file()]

    def put(p: Path) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{p.relative_to(root)}", Body=p.read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))


def run_child(src: str, output: str, endpoint, workers: int, batches: int) -> dict:
    """One measuring process on ``src``'s code; with S3, the requests of each step counted from the server."""
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, __file__, "--measure", output, "--workers", str(workers)]
    if endpoint is not None:
        cmd += ["--endpoint", endpoint.url]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    got: dict = {}
    counting = endpoint.requests() if endpoint is not None else None
    seen = counting.__enter__() if counting is not None else []
    try:
        mark = 0
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if endpoint is not None:
                time.sleep(0.3)  # the server logs a request as it finishes answering it
                if row["step"] != "start":
                    row["requests_per_batch"] = (len(seen) - mark) / batches
                mark = len(seen)
                proc.stdin.write("go\n")
                proc.stdin.flush()
            got[row.pop("step")] = row
    finally:
        if counting is not None:
            counting.__exit__(None, None, None)
        proc.wait()
    if proc.returncode:
        raise SystemExit(f"the measuring process on {src} failed ({proc.returncode})")
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="500,4800")
    p.add_argument("--before", help="src directory of the code to compare with (e.g. /work/main/src)")
    p.add_argument("--dir", default="/tmp/hsextract-bench-scale-read")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        return measure(args.measure, args.endpoint, args.workers)
    sizes = [int(n) for n in args.batches.split(",")]
    outputs = make_outputs(args, sizes)
    trees = ([("before", args.before)] if args.before else []) + [("after", str(ROOT / "src"))]
    stores: list[tuple[str, object]] = [("local", None)]
    if not args.no_s3:
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        from s3server import FAKE_CREDENTIALS, REGION, S3Endpoint

        os.environ.update(FAKE_CREDENTIALS, AWS_DEFAULT_REGION=REGION, AWS_EC2_METADATA_DISABLED="true")
        logging.getLogger("werkzeug").addHandler(logging.NullHandler())  # its own line per request otherwise
        endpoint = S3Endpoint()
        bucket = endpoint.create_bucket()
        for n, path in outputs.items():
            upload(endpoint, bucket, f"synthetic-{n}", path)
        stores.append(("s3", endpoint))
    header = (
        f"{'code':6} {'store':5} {'batches':>7} {'samples':>8} {'open_output s':>13} {'status s':>8} "
        f"{'dataset s':>9} {'first item s':>12} {'CPU s: open':>11} {'status':>6} {'dataset':>7} "
        f"{'worker MB':>9} {'pickle MB':>9} {'GETs/batch: open':>16} {'status':>6} {'dataset':>7}"
    )
    print(header)
    for n, path in outputs.items():
        samples = len(json.loads((path / "hsextract" / "sample_ids.json").read_text()))
        for store, endpoint in stores:
            output = str(path) if endpoint is None else f"s3://{bucket}/synthetic-{n}"
            for code, src in trees:
                r = run_child(src, output, endpoint, args.workers, n)
                per = [r[s].get("requests_per_batch") for s in ("open_output", "status", "dataset")]
                per_text = " ".join(
                    f"{x:>{w}.2f}" if x is not None else f"{'-':>{w}}"
                    for x, w in zip(per, (16, 6, 7), strict=True)
                )
                cpu = " ".join(
                    f"{r[s]['cpu_s']:>{w}.2f}"
                    for s, w in zip(("open_output", "status", "dataset"), (11, 6, 7), strict=True)
                )
                print(
                    f"{code:6} {store:5} {n:>7} {samples:>8} {r['open_output']['s']:>13.2f} {r['status']['s']:>8.2f} "
                    f"{r['dataset']['s']:>9.2f} {r['first_item']['s']:>12.2f} {cpu} "
                    f"{r['memory']['worker_mb']:>9.0f} {r['dataset']['pickle_mb']:>9.2f} {per_text}",
                    flush=True,
                )
    if not args.no_s3:
        endpoint.stop()


if __name__ == "__main__":
    main()
