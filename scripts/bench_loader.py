"""What a trainer's data loader delivers, side by side on one output: samples/s and GB/s of states with 1, 2 and 4
DataLoader workers, for (i) the trainer's own loader on ``hsextract export`` (SpecForge's ``load_feature_file`` of
one ``data_I.ckpt`` per sample, a ``torch.utils.data`` map dataset, shuffled), (ii) ``StatesDataset`` of
``hsextract.training`` on the local output, (iii) the same from a real S3 server on loopback (SeaweedFS, the tests'
server from tests/support/s3server.py, started here). All feed the same DataLoader with ``batch_size=None`` and the
DFlash schema; the states cross from the workers into this process as the trainer would get them. Also the bytes
each variant read against the bytes of states delivered, and what the server takes for a ranged GET of 1 byte of a
batch file (its per-request cost).

The output is synthetic and shaped like the default target's (Qwen3.6-27B, DFlash: 5 layers x 5120 hidden, bf16:
51,200 bytes of states per token), sample lengths drawn around the realistic mix (median ~220 tokens), written under
``--dir`` (/dev/shm by default). Each figure is the best of ``--repeat`` epochs (the fastest), and the least CPU
seconds per GB of states an epoch took (main process and workers together: a second view, less at the mercy of
other work); the variants take turns within each repeat, so on a shared machine they see the same load.
``--in-file-order`` turns the shuffle off (every variant); ``--unverified`` adds (ii) without checksums.

    python scripts/bench_loader.py                    # 4 files x 4096 tokens, ~0.84 GB of states
    python scripts/bench_loader.py --files 8 --tokens 16384 --workers 1,2,4,8 --no-s3 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from hsextract.export.runner import export
from hsextract.format.batch import batch_metadata, header_checksum, read_file_head
from hsextract.format.manifest import MANIFEST, OUTPUT_FORMAT, OUTPUT_FORMAT_VERSION
from hsextract.run.writer import write_batch_file
from hsextract.storage.base import read_with_crc32
from hsextract.storage.local import LocalSink
from hsextract.training import StatesDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

LAYERS, HIDDEN = (1, 16, 31, 46, 61), 5120

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


def make_output(out: Path, files: int, tokens: int, seed: int = 0) -> dict:
    """``files`` batch files of ``tokens`` tokens each, random bf16 states, and their manifest."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batches, n_samples = [], 0
    for b in range(files):
        lengths = []
        while sum(lengths) < tokens:
            lengths.append(max(2, min(int(rng.lognormvariate(5.4, 0.8)), 4096)))
        lengths[-1] -= sum(lengths) - tokens
        lengths = [n for n in lengths if n > 1]
        n = sum(lengths)
        ids = [f"s{n_samples + i:06d}" for i in range(len(lengths))]
        n_samples += len(lengths)
        tensors = {
            "hidden_states": torch.randn(n, len(LAYERS), HIDDEN, generator=gen).to(torch.bfloat16),
            "input_ids": torch.randint(0, 150_000, (n,), generator=gen, dtype=torch.int32),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
            "sample_index": torch.arange(len(lengths), dtype=torch.int64),
        }
        key = f"shard-00000/batch-{b:06d}.safetensors"
        path = out / key
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = batch_metadata(
            run_meta={"layer_ids": json.dumps(list(LAYERS)), "dtype": "bfloat16"},
            batch_id=b,
            shard=0,
            sample_ids=ids,
        )
        write_batch_file(path, tensors, meta)
        size, crc = read_with_crc32(path)
        head = read_file_head(path)
        batches.append(
            {
                "key": key,
                "batch_id": b,
                "shard": 0,
                "num_tokens": n,
                "sample_ids": ids,
                "size": size,
                "crc32": f"{crc:08x}",
                "header_size": len(head),
                "header_xxh3": header_checksum(head),
            }
        )
    manifest = {
        "format": OUTPUT_FORMAT,
        "format_version": OUTPUT_FORMAT_VERSION,
        "layer_ids": list(LAYERS),
        "num_layers": 64,
        "slot_layer_ids": list(LAYERS),
        "final_state": None,
        "storage_dtype": None,
        "hidden_size": HIDDEN,
        "vocab_size": 248_320,
        "num_samples": n_samples,
        "num_tokens": files * tokens,
        "batches": batches,
    }
    (out / MANIFEST).write_text(json.dumps(manifest))
    return manifest


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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch file (51,200 B each)")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--threads", type=int, default=4, help="StatesDataset read threads per worker")
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument(
        "--unverified", action="store_true", help="also (ii) with verify=False: what the checksums cost"
    )
    parser.add_argument(
        "--in-file-order",
        action="store_true",
        help="no shuffle: samples in manifest order (as export reads them)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",")]

    _count_reads(LocalSink)
    work = Path(tempfile.mkdtemp(prefix="hsextract-bench-loader-", dir=args.dir))
    r: dict = {"files": args.files, "tokens_per_file": args.tokens, "torch_threads": torch.get_num_threads()}
    stack = contextlib.ExitStack()  # the S3 server, stopped and its data deleted whatever happens
    try:
        out = work / "out"
        manifest = make_output(out, args.files, args.tokens)
        r["samples"] = manifest["num_samples"]
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
            r["s3_get_s"] = s3_get_seconds(client, f"out/{manifest['batches'][0]['key']}")
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


if __name__ == "__main__":
    sys.exit(main())
