"""What a trainer's data loader delivers from an output: GB/s of states, side by side.

    python scripts/bench_loader.py workers --files 6 --tokens 16384 --workers 1,2,4 --repeat 2
    python scripts/bench_loader.py gpu --files 6 --tokens 16384 --threads 1,4,8 --repeat 2

The output is synthetic, shaped like the default target's (Qwen3.6-27B, DFlash: 5 layers x 5120 hidden, bf16:
51,200 bytes of states per token; the realistic length mix), written as a run writes one under ``--dir``
(/dev/shm by default).

``workers``: samples/s and GB/s with 1, 2 and 4 DataLoader workers for (i) the trainer's own loader on
``hsextract export`` (SpecForge's ``load_feature_file`` of one ``data_I.ckpt`` per sample, shuffled), (ii)
``StatesDataset`` on the local output, (iii) the same from SeaweedFS on loopback (the tests' server, started here),
all with ``batch_size=None`` and the DFlash schema; also the bytes read against the bytes of states delivered, the
CPU seconds per GB (main process and workers: less at the mercy of other work than seconds), and the server's time
for a ranged GET of 1 byte. Each figure is the best of ``--repeat`` epochs; the variants take turns within each
repeat, so on a shared machine they see the same load. ``--in-file-order`` turns the shuffle off; ``--unverified``
adds (ii) without checksums.

``gpu``: one loader process (``StatesDataset``, ``--threads`` read threads) into a pinned host buffer and on to the
GPU (non-blocking, one stream), as a training loop's ``pin_memory`` + ``.cuda()``: GB/s, and how many such
processes ~3 GB/s of states per GPU needs. Without CUDA, plain memory only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from benchlib import realistic_output
from torch.utils.data import DataLoader, Dataset

from hsextract.export.runner import export
from hsextract.storage.local import LocalSink
from hsextract.training import StatesDataset

NEED_GBPS = 3.0  # a 1B-parameter drafter on an H200 (docs/PERFORMANCE.md, "Training loader")

_read_bytes = mp.Value("q", 0)
_inside = threading.local()  # LocalSink.read_range reads through read_range_into: count the bytes once


def _count_reads(sink_class) -> None:
    """Count the bytes every read of ``sink_class`` returns, in all processes (workers included)."""

    def counting(method, size):
        def counted(self, *args):
            outer = not getattr(_inside, "active", False)
            _inside.active = True
            try:
                result = method(self, *args)
            finally:
                _inside.active = not outer
            if outer:
                with _read_bytes.get_lock():
                    _read_bytes.value += size(result)
            return result

        return counted

    sink_class.read_range = counting(sink_class.read_range, len)
    if hasattr(sink_class, "read_range_into"):  # not in hsextract before 2026-12-01 (a run of older code)
        sink_class.read_range_into = counting(sink_class.read_range_into, int)


class ExportFiles(Dataset):
    """SpecForge's own offline read: ``load_feature_file`` of one ``.ckpt`` per sample."""

    def __init__(self, files: list[str]):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from specforge.runtime.data_plane.feature_store import load_feature_file

        return load_feature_file(self.files[i])


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process and of its children that have ended (DataLoader workers end with each epoch)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def epoch(loader) -> dict:
    """One pass over ``loader``: seconds, samples, bytes of states delivered and bytes read, and the CPU seconds
    the main process and the workers spent (less sensitive than seconds to what else runs on a shared machine)."""
    _read_bytes.value = 0
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    samples = delivered = 0
    for item in loader:
        samples += 1
        delivered += item["hidden_states"].numel() * item["hidden_states"].element_size()
    seconds = time.perf_counter() - t0
    del loader  # its workers end
    main_cpu, workers_cpu = (b - a for a, b in zip(cpu0, _cpu_seconds(), strict=True))
    return {
        "seconds": seconds,
        "samples": samples,
        "state_bytes": delivered,
        "read": _read_bytes.value,
        "cpu_main_s": main_cpu,
        "cpu_workers_s": workers_cpu,
        "cpu_s_per_GB": (main_cpu + workers_cpu) / (delivered / 1e9),
    }


def s3_get_seconds(client, key: str, repeat: int = 5) -> float:
    """What the server takes for a ranged GET of 1 byte of ``key``: its cost per request."""
    t0 = time.perf_counter()
    for _ in range(repeat):
        client.get_object(Bucket="bench", Key=key, Range="bytes=0-0")["Body"].read()
    return (time.perf_counter() - t0) / repeat


def workers_bench(args) -> int:
    workers = [int(w) for w in args.workers.split(",")]

    _count_reads(LocalSink)
    work = Path(tempfile.mkdtemp(prefix="hsextract-bench-loader-", dir=args.dir))
    r: dict = {"files": args.files, "tokens_per_file": args.tokens, "torch_threads": torch.get_num_threads()}
    stack = contextlib.ExitStack()  # the S3 server, stopped and its data deleted whatever happens
    try:
        out = work / "out"
        made = realistic_output(out, args.files, args.tokens)
        r["samples"] = len(made["sample_ids"])
        dest = work / "export"
        t0 = time.perf_counter()
        export(str(out), str(dest), "specforge-dflash", num_proc=2, show_progress=False, echo=lambda *_: None)
        r["export_s"] = time.perf_counter() - t0
        files = sorted(str(p) for p in dest.rglob("*.ckpt"))
        r["export_bytes"] = sum(Path(f).stat().st_size for f in files)
        shuffle = not args.in_file_order
        variants = {
            "export+own_loader": lambda w: DataLoader(
                ExportFiles(files), batch_size=None, shuffle=shuffle, num_workers=w
            ),
            "hsextract_local": lambda w: DataLoader(
                StatesDataset(
                    out, "specforge-dflash", shuffle=shuffle, threads=args.threads, prefetch=4 * args.threads
                ),
                batch_size=None,
                num_workers=w,
            ),
        }
        if args.unverified:
            variants["hsextract_local_unverified"] = lambda w: DataLoader(
                StatesDataset(
                    out,
                    "specforge-dflash",
                    shuffle=shuffle,
                    threads=args.threads,
                    prefetch=4 * args.threads,
                    verify=False,
                ),
                batch_size=None,
                num_workers=w,
            )
        if not args.no_s3:
            from support.s3server import FAKE_CREDENTIALS, REGION, S3Endpoint

            from hsextract.storage.s3 import S3Sink

            _count_reads(S3Sink)
            os.environ.update(FAKE_CREDENTIALS, AWS_DEFAULT_REGION=REGION)
            server = stack.enter_context(S3Endpoint())
            client = server.client()
            client.create_bucket(Bucket="bench")
            for p in sorted(out.rglob("*")):
                if p.is_file():
                    client.upload_file(str(p), "bench", f"out/{p.relative_to(out).as_posix()}")
            r["s3_get_s"] = s3_get_seconds(client, f"out/{made['plan'].batches[0].key}")
            variants["hsextract_s3_loopback"] = lambda w: DataLoader(
                StatesDataset(
                    "s3://bench/out",
                    "specforge-dflash",
                    endpoint_url=server.url,
                    shuffle=shuffle,
                    threads=args.threads,
                    prefetch=4 * args.threads,
                ),
                batch_size=None,
                num_workers=w,
            )
        # Variants take turns within each repeat, so that all of them see the same load on a shared machine.
        r["runs"] = {}
        for w in workers:
            for _ in range(args.repeat):
                for name, make in variants.items():
                    res = epoch(make(w))
                    if name == "export+own_loader":
                        res["read"] = r["export_bytes"]  # whole files, every one once
                    best = r["runs"].get(f"{name}/{w}")
                    if best is not None:
                        res["cpu_s_per_GB"] = min(res["cpu_s_per_GB"], best["cpu_s_per_GB"])
                    if best is None or res["seconds"] < best["seconds"]:
                        r["runs"][f"{name}/{w}"] = res
                    else:
                        best["cpu_s_per_GB"] = res["cpu_s_per_GB"]
        for res in r["runs"].values():
            res["samples_per_s"] = res["samples"] / res["seconds"]
            res["GBps"] = res["state_bytes"] / res["seconds"] / 1e9
            res["read_over_delivered"] = res["read"] / res["state_bytes"]
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"{r['samples']} samples in {args.files} files of {args.tokens} tokens; export took {r['export_s']:.1f} s\n"
        f"{'variant/workers':32} {'samples/s':>10} {'GB/s':>7} {'read/delivered':>15} {'CPU s/GB':>9}"
    )
    for k, v in r["runs"].items():
        print(
            f"{k:32} {v['samples_per_s']:10.0f} {v['GBps']:7.3f} {v['read_over_delivered']:15.3f} "
            f"{v['cpu_s_per_GB']:9.2f}"
        )
    for w in workers:
        if f"hsextract_s3_loopback/{w}" in r["runs"]:
            s3, local = r["runs"][f"hsextract_s3_loopback/{w}"], r["runs"][f"hsextract_local/{w}"]
            print(f"(iii)/(ii) with {w} workers: {s3['GBps'] / local['GBps']:.2f}")
    if "s3_get_s" in r:
        print(
            f"the S3 server takes {r['s3_get_s'] * 1e3:.1f} ms for a ranged GET of 1 byte of one batch file"
        )
    return 0


def deliver(out: Path, threads: int, cuda: bool) -> tuple[float, int]:
    """GB/s of states from ``StatesDataset`` in this process into a pinned buffer (and on to the GPU with
    ``cuda``), and the bytes delivered."""
    data = StatesDataset(str(out), schema="specforge-dflash", shuffle=True, seed=0, threads=threads)
    stream = torch.cuda.Stream() if cuda else None
    pinned: torch.Tensor | None = None
    nbytes = 0
    t0 = time.perf_counter()
    for item in data:
        states = item["hidden_states"]
        if pinned is None or pinned.numel() < states.numel():
            pinned = torch.empty(states.numel() * 2, dtype=states.dtype, pin_memory=cuda)
        host = pinned[: states.numel()].view_as(states)
        if stream is not None:
            stream.synchronize()  # the last copy out of the buffer is done before it is refilled
        host.copy_(states)
        if stream is not None:
            with torch.cuda.stream(stream):
                host.to("cuda", non_blocking=True)
        nbytes += states.numel() * states.element_size()
    if stream is not None:
        stream.synchronize()
    return nbytes / (time.perf_counter() - t0) / 1e9, nbytes


def gpu_bench(args) -> int:
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hsx-loader-") as tmp:
        out = Path(tmp) / "out"
        realistic_output(out, args.files, args.tokens)
        print(
            f"figure output {args.files} files x {args.tokens} tokens in {args.dir}; cuda {cuda}", flush=True
        )
        for threads in map(int, args.threads.split(",")):
            for target in ("host", "gpu") if cuda else ("host",):
                best, nbytes = 0.0, 0
                for _ in range(args.repeat):
                    rate, nbytes = deliver(out, threads, cuda and target == "gpu")
                    best = max(best, rate)
                print(
                    f"figure threads_{threads}.{target}_gbps {best:.2f} ({nbytes / 1e9:.2f} GB; "
                    f"processes for {NEED_GBPS:g} GB/s: {-(-NEED_GBPS // best):.0f})",
                    flush=True,
                )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("workers", help="DataLoader workers: the export, the local output, the output over S3")
    g = sub.add_parser("gpu", help="one loader process into pinned memory and the GPU")
    for p in (w, g):
        p.add_argument("--files", type=int, default=4)
        p.add_argument("--tokens", type=int, default=4096, help="tokens per batch file (51,200 B each)")
        p.add_argument("--dir", default="/dev/shm")
        p.add_argument("--repeat", type=int, default=2)
    w.add_argument("--workers", default="1,2,4")
    w.add_argument("--threads", type=int, default=4, help="StatesDataset read threads per worker")
    w.add_argument("--no-s3", action="store_true")
    w.add_argument(
        "--unverified", action="store_true", help="also (ii) with verify=False: what the checksums cost"
    )
    w.add_argument("--in-file-order", action="store_true", help="no shuffle: samples in manifest order")
    w.add_argument("--json", action="store_true")
    g.add_argument("--threads", default="1,4,8", help="read threads of the one process, each count in turn")
    args = parser.parse_args()
    return workers_bench(args) if args.what == "workers" else gpu_bench(args)


if __name__ == "__main__":
    sys.exit(main())
