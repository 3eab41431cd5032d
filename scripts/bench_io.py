"""What the output's bytes cost on their way: the checks that guard them, and the uploader that makes them durable.

    python scripts/bench_io.py checks [--tokens 24576] [--repeat 5] [--dir /dev/shm] [--json]
    python scripts/bench_io.py upload [--files 40] [--size-mib 64]

``checks``: one batch file of the default target (Qwen3.6-27B, DFlash: 5 layers x 5120, bf16, 51,200 bytes a
token; the realistic length mix), each figure the best of ``--repeat``: checksum speeds on one core (xxh3 of the
samples, zlib's CRC32), the writer thread's seconds per batch without checksums, with the file's CRC32 (a second
thread beside the write) and with the samples' xxh3 too; the CRC32 of the file read back (what a local output's
upload and ``verify`` read); the reader per sample verified and not; ``hsextract verify`` GB/s; on CUDA, the
per-batch state check (NaN/Inf/all-zero) on the device. Each cost is also given as a fraction of the batch's
forward at ``--tokens-per-s``.

``upload``: staged files through the ``Uploader`` into SeaweedFS on loopback (the tests' server, started here: it
checks every part's and the whole object's CRC32 and shares this machine's cores) and into a local directory
(copy + fsync + rename): the uploader's own rate on one machine, not a prediction of S3 bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

from benchlib import DFLASH_LAYERS, HIDDEN, best_of, cuda_ms, realistic_output


def checks(args) -> dict:
    import torch
    import xxhash

    from hsextract.output import open_output, verify_output, writer
    from hsextract.storage.base import read_with_crc32

    work = Path(tempfile.mkdtemp(prefix="hsextract-bench-io-", dir=args.dir))
    try:
        out = work / "out"
        made = realistic_output(out, 1, args.tokens)
        spec = made["plan"].batches[0]
        path = out / spec.key
        tensors = {k: t.clone() for k, t in _load(path).items()}
        meta = writer.read_metadata(path)
        states = tensors["hidden_states"]
        data = memoryview(states.reshape(-1).view(torch.uint8).numpy())
        gb = len(data) / 1e9
        forward_s = args.tokens / args.tokens_per_s
        r: dict = {
            "tokens": states.shape[0],
            "samples": spec.rows,
            "file_bytes": path.stat().st_size,
            "forward_s": forward_s,
        }
        # Checksum speed, one core, on the states.
        r["xxh3_64_GBps"] = gb / best_of(args.repeat, lambda: xxhash.xxh3_64(data).hexdigest())
        r["crc32_GBps"] = gb / best_of(args.repeat, lambda: zlib.crc32(data))
        r["batch_checksums_s"] = best_of(args.repeat, lambda: writer.batch_checksums(tensors))
        # The writer thread per batch (file, fsync, rename): no checksum, the file's CRC32, and the samples' too.
        staged = work / "staged.safetensors"
        crc32_of = writer.crc32_of
        try:
            writer.crc32_of = lambda parts: 0
            r["write_plain_s"] = best_of(args.repeat, lambda: writer.write_safetensors(staged, tensors, meta))
        finally:
            writer.crc32_of = crc32_of
        r["write_crc32_s"] = best_of(args.repeat, lambda: writer.write_safetensors(staged, tensors, meta))
        r["write_with_checksums_s"] = best_of(
            args.repeat, lambda: writer.write_batch_file(staged, tensors, meta)
        )
        r["writer_overhead"] = r["write_with_checksums_s"] / r["write_plain_s"] - 1
        # The file's CRC32 read back from the page cache, as a just-written file is.
        read_with_crc32(staged)
        s = best_of(args.repeat, lambda: read_with_crc32(staged))
        r["crc32_file_GBps"] = r["file_bytes"] / 1e9 / s
        r["crc32_file_of_forward"] = s / forward_s
        staged.unlink()
        # The reader: every sample once, verified or not (the file is in RAM: the worst case for the overhead).
        for verify in (False, True):
            reader = open_output(out, verify=verify)
            ids = made["sample_ids"]
            seconds = best_of(args.repeat, lambda reader=reader, ids=ids: [reader[sid] for sid in ids])
            key = "verified" if verify else "unverified"
            r[f"reader_{key}_ms_per_sample"] = seconds / len(ids) * 1e3
            r[f"reader_{key}_GBps"] = gb / seconds
        r["reader_overhead"] = r["reader_verified_ms_per_sample"] / r["reader_unverified_ms_per_sample"] - 1
        # hsextract verify: size, CRC32, header, every sample, one pass.
        verify_s = best_of(args.repeat, lambda: verify_output(str(out), workers=1, show_progress=False))
        r["verify_GBps"] = r["file_bytes"] / 1e9 / verify_s
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if torch.cuda.is_available():
        from hsextract.run.pipeline import state_health

        states = torch.randn(args.tokens, len(DFLASH_LAYERS), HIDDEN, device="cuda", dtype=torch.bfloat16)
        scale = states.float().abs().amax(dim=2)
        for name, scales in (("bf16", None), ("fp8_scale", scale)):
            ms = cuda_ms(lambda scales=scales: state_health(states, scales))
            r[f"state_check_{name}_ms"] = ms
            r[f"state_check_{name}_of_forward"] = ms / 1e3 / forward_s
    if args.json:
        print(json.dumps(r, indent=2))
        return r
    lines = [
        f"batch: {r['tokens']} tokens, {r['samples']} samples, {r['file_bytes'] / 1e9:.2f} GB file in {args.dir}; "
        f"its forward at {args.tokens_per_s:,.0f} tokens/s: {forward_s:.2f} s",
        f"checksum speed, one core: xxh3_64 {r['xxh3_64_GBps']:.1f} GB/s, zlib crc32 {r['crc32_GBps']:.1f} GB/s",
        f"writer thread per batch: no checksum {r['write_plain_s']:.3f} s, with the file's CRC32 "
        f"{r['write_crc32_s']:.3f} s, with the samples' xxh3 too {r['write_with_checksums_s']:.3f} s "
        f"(+{r['writer_overhead']:.0%}; sample checksums alone {r['batch_checksums_s']:.3f} s)",
        f"CRC32 of the file read back: {r['crc32_file_GBps']:.2f} GB/s ({r['crc32_file_of_forward']:.3f} of the "
        "forward)",
        f"reader per sample (mean {r['tokens'] / r['samples']:.0f} tokens): unverified "
        f"{r['reader_unverified_ms_per_sample']:.2f} ms, verified {r['reader_verified_ms_per_sample']:.2f} ms "
        f"(+{r['reader_overhead']:.0%}); {r['reader_unverified_GBps']:.2f} vs {r['reader_verified_GBps']:.2f} GB/s",
        f"hsextract verify, one worker: {r['verify_GBps']:.2f} GB/s",
    ]
    for name in ("bf16", "fp8_scale"):
        if f"state_check_{name}_ms" in r:
            lines.append(
                f"state check on the GPU, {name}: {r[f'state_check_{name}_ms']:.2f} ms per batch "
                f"({r[f'state_check_{name}_of_forward']:.5f} of the forward)"
            )
    print("\n".join(lines))
    return r


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def upload(args) -> dict:
    from support.s3server import FAKE_CREDENTIALS, REGION, S3Endpoint

    from hsextract.run.uploader import Uploader
    from hsextract.storage.base import MiB

    os.environ.update(FAKE_CREDENTIALS, AWS_DEFAULT_REGION=REGION)  # the keys the server knows
    total_mb = args.files * args.size_mib * MiB / 1e6
    r: dict = {}
    with S3Endpoint() as endpoint, tempfile.TemporaryDirectory(prefix="hsextract-bench-") as work_dir:
        bucket = endpoint.create_bucket()
        targets = {
            "s3 (SeaweedFS, loopback)": (f"s3://{bucket}/bench", endpoint.url),
            "local dir": (str(Path(work_dir) / "out"), None),
        }
        for label, (output, endpoint_url) in targets.items():
            with tempfile.TemporaryDirectory(prefix="hsextract-staging-", dir=args.staging) as staging:
                staged = _stage(Path(staging), args.files, args.size_mib * MiB)
                uploader = Uploader(
                    output=output,
                    endpoint_url=endpoint_url,
                    log_file=Path(work_dir) / f"{label.split()[0]}-uploader.log",
                    concurrency=args.concurrency,
                )
                uploader.start()
                start = time.monotonic()
                for path, key in staged:
                    uploader.submit(path, key)
                done = uploader.close()
                seconds = time.monotonic() - start
                if len(done) != len(staged):
                    raise SystemExit(f"{label}: {len(done)} of {len(staged)} files confirmed")
            r[label] = total_mb / seconds
            print(
                f"{label}: {args.files} x {args.size_mib} MiB = {total_mb:.0f} MB in {seconds:.1f} s "
                f"-> {total_mb / seconds:.0f} MB/s (concurrency {args.concurrency})",
                flush=True,
            )
    return r


def _stage(staging: Path, files: int, size: int) -> list[tuple[Path, str]]:
    block = bytearray(os.urandom(size))
    staged = []
    for i in range(files):
        block[:8] = i.to_bytes(8, "little")  # distinct content per file
        path = staging / f"batch-{i:06d}.safetensors"
        path.write_bytes(block)
        staged.append((path, f"shard-00000/batch-{i:06d}.safetensors"))
    return staged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("checks", help="checksums, the writer thread, the reader, verify, the state check")
    c.add_argument("--tokens", type=int, default=24_576, help="tokens in the batch (51,200 B each)")
    c.add_argument("--tokens-per-s", type=float, default=12_250.0, help="the forward's steady state")
    c.add_argument("--dir", default="/dev/shm", help="where the batch file is written")
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--json", action="store_true")
    u = sub.add_parser("upload", help="the uploader into SeaweedFS on loopback and into a local directory")
    u.add_argument("--files", type=int, default=40)
    u.add_argument("--size-mib", type=int, default=64)
    u.add_argument("--concurrency", type=int, default=4)
    u.add_argument("--staging", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = ap.parse_args()
    {"checks": checks, "upload": upload}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
