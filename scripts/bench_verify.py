"""What verification costs, on a realistic batch file: checksum GB/s, writer-thread overhead per batch, reader
overhead per sample with and without verification, and ``hsextract verify`` GB/s.

The batch is the default target's (Qwen3.6-27B, DFlash: 5 layers x 5120 hidden, bf16: 51,200 bytes of states per
token) with random states and sample lengths drawn around the realistic mix (median ~220 tokens), written to
/dev/shm like the worker's staging. Every figure is the best of ``--repeat`` runs (the machine is shared).

    python scripts/bench_verify.py                      # ~1.3 GB batch in /dev/shm
    python scripts/bench_verify.py --tokens 49152 --json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash

from hsextract.format.batch import batch_metadata, header_checksum, read_file_head
from hsextract.format.manifest import MANIFEST, OUTPUT_FORMAT, OUTPUT_FORMAT_VERSION
from hsextract.reader import open_output
from hsextract.run.writer import batch_checksums, write_batch_file, write_safetensors
from hsextract.storage.base import read_with_crc32
from hsextract.verify import verify_output

LAYERS, HIDDEN = (1, 16, 31, 46, 61), 5120


def make_batch(num_tokens: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[str]]:
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < num_tokens and len(lengths) < 512:
        lengths.append(max(1, min(int(rng.lognormvariate(5.4, 0.8)), 4096)))
    lengths[-1] -= sum(lengths) - num_tokens
    lengths = [n for n in lengths if n > 0]
    n = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "hidden_states": torch.randn(n, len(LAYERS), HIDDEN, generator=gen, dtype=torch.float32).to(
            torch.bfloat16
        ),
        "input_ids": torch.randint(0, 150_000, (n,), generator=gen, dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        "sample_index": torch.arange(len(lengths), dtype=torch.int64),
    }
    return tensors, [f"s{i:05d}" for i in range(len(lengths))]


def best(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=24_576, help="tokens in the batch (51,200 B each)")
    parser.add_argument("--dir", default="/dev/shm", help="where the batch file is written")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    tensors, sample_ids = make_batch(args.tokens)
    states = tensors["hidden_states"]
    data = memoryview(states.reshape(-1).view(torch.uint8).numpy())
    gb = len(data) / 1e9
    r: dict = {
        "tokens": states.shape[0],
        "samples": len(sample_ids),
        "state_bytes": len(data),
        "torch_threads": torch.get_num_threads(),
    }

    # 1. Raw checksum speed, one core, on the states.
    r["xxh3_64_GBps"] = gb / best(args.repeat, lambda: xxhash.xxh3_64(data).hexdigest())
    r["crc32_GBps"] = gb / best(args.repeat, lambda: zlib.crc32(data))
    r["batch_checksums_s"] = best(args.repeat, lambda: batch_checksums(tensors))

    work = Path(tempfile.mkdtemp(prefix="hsextract-bench-verify-", dir=args.dir))
    try:
        meta = batch_metadata(
            run_meta={"layer_ids": json.dumps(list(LAYERS)), "dtype": "bfloat16"},
            batch_id=0,
            shard=0,
            sample_ids=sample_ids,
        )
        # 2. The writer thread's time per batch, without and with the checksums (file to /dev/shm, fsync, rename).
        plain = work / "plain.safetensors"
        r["write_plain_s"] = best(args.repeat, lambda: write_safetensors(plain, tensors, meta))
        plain.unlink()
        out = work / "out"
        path = out / "shard-00000" / "batch-000000.safetensors"
        path.parent.mkdir(parents=True)
        r["write_with_checksums_s"] = best(args.repeat, lambda: write_batch_file(path, tensors, meta))
        r["writer_overhead"] = r["write_with_checksums_s"] / r["write_plain_s"] - 1
        r["file_bytes"] = path.stat().st_size

        # The manifest the launcher would write from the uploader's marker.
        size, crc = read_with_crc32(path)
        head = read_file_head(path)
        manifest = {
            "format": OUTPUT_FORMAT,
            "format_version": OUTPUT_FORMAT_VERSION,
            "layer_ids": list(LAYERS),
            "batches": [
                {
                    "key": "shard-00000/batch-000000.safetensors",
                    "batch_id": 0,
                    "shard": 0,
                    "sample_ids": sample_ids,
                    "size": size,
                    "crc32": f"{crc:08x}",
                    "header_size": len(head),
                    "header_xxh3": header_checksum(head),
                }
            ],
        }
        (out / MANIFEST).write_text(json.dumps(manifest))

        # 3. Reader: every sample once, verified or not (the file is in RAM: the worst case for the overhead).
        for verify in (False, True):
            reader = open_output(out, verify=verify)

            def read_all(reader=reader):
                for sid in sample_ids:
                    reader[sid]

            seconds = best(args.repeat, read_all)
            key = "verified" if verify else "unverified"
            r[f"reader_{key}_ms_per_sample"] = seconds / len(sample_ids) * 1e3
            r[f"reader_{key}_GBps"] = gb / seconds
        r["reader_overhead"] = r["reader_verified_ms_per_sample"] / r["reader_unverified_ms_per_sample"] - 1

        # 4. hsextract verify over the file: size, CRC32, header, every sample, one pass.
        r["verify_GBps"] = (
            r["file_bytes"]
            / 1e9
            / best(args.repeat, lambda: verify_output(str(out), workers=1, show_progress=False))
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"batch: {r['tokens']} tokens, {r['samples']} samples, {r['file_bytes'] / 1e9:.2f} GB file in {args.dir}\n"
        f"checksum speed, one core: xxh3_64 {r['xxh3_64_GBps']:.1f} GB/s, zlib crc32 {r['crc32_GBps']:.1f} GB/s\n"
        f"writer thread per batch: plain {r['write_plain_s']:.3f} s, with checksums "
        f"{r['write_with_checksums_s']:.3f} s (+{r['writer_overhead']:.0%}; checksums alone "
        f"{r['batch_checksums_s']:.3f} s)\n"
        f"reader per sample (mean {r['tokens'] / r['samples']:.0f} tokens): unverified "
        f"{r['reader_unverified_ms_per_sample']:.2f} ms, verified {r['reader_verified_ms_per_sample']:.2f} ms "
        f"(+{r['reader_overhead']:.0%}); {r['reader_unverified_GBps']:.2f} vs {r['reader_verified_GBps']:.2f} GB/s\n"
        f"hsextract verify, one worker: {r['verify_GBps']:.2f} GB/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
