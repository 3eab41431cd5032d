"""Throughput of the uploader process: staged files -> Uploader -> a real S3 server on loopback (and a local dir).

    python scripts/bench_uploader.py --files 40 --size-mib 64

The server is SeaweedFS, the tests' (tests/support/s3server.py), started here: it verifies each part's and the
whole object's CRC32 and writes to the local disk, sharing this machine's cores with the uploader, so the figure is
the uploader's own rate on one machine (CRC32, transfer manager, process hand-off, the server's work), not a
prediction of S3 bandwidth. The local-dir figure is bounded by copy + fsync to the target disk.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.s3server import FAKE_CREDENTIALS, REGION, S3Endpoint  # noqa: E402

from hsextract.run.uploader import Uploader  # noqa: E402
from hsextract.storage.base import MiB  # noqa: E402


def stage(staging: Path, files: int, size: int) -> list[tuple[Path, str]]:
    block = bytearray(os.urandom(size))
    staged = []
    for i in range(files):
        block[:8] = i.to_bytes(8, "little")  # distinct content per file
        path = staging / f"batch-{i:06d}.safetensors"
        path.write_bytes(block)
        staged.append((path, f"shard-00000/batch-{i:06d}.safetensors"))
    return staged


def run(
    output: str, endpoint_url: str | None, staged: list[tuple[Path, str]], work: Path, concurrency: int
) -> float:
    uploader = Uploader(
        output=output,
        endpoint_url=endpoint_url,
        marker_dir=work / "markers",
        log_file=work / "uploader.log",
        concurrency=concurrency,
    )
    uploader.start()
    start = time.monotonic()
    for path, key in staged:
        uploader.submit(path, key)
    done = uploader.close()
    seconds = time.monotonic() - start
    assert len(done) == len(staged), f"{len(done)} of {len(staged)} confirmed"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--staging", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = parser.parse_args()
    os.environ.update(FAKE_CREDENTIALS, AWS_DEFAULT_REGION=REGION)  # the keys the server knows

    total_mb = args.files * args.size_mib * MiB / 1e6
    with S3Endpoint() as endpoint, tempfile.TemporaryDirectory(prefix="hsextract-bench-") as work_dir:
        bucket = endpoint.create_bucket()
        targets = {"s3 (SeaweedFS, loopback)": (f"s3://{bucket}/bench", endpoint.url)}
        targets["local dir"] = (str(Path(work_dir) / "out"), None)
        for label, (output, endpoint_url) in targets.items():
            with tempfile.TemporaryDirectory(prefix="hsextract-staging-", dir=args.staging) as staging:
                staged = stage(Path(staging), args.files, args.size_mib * MiB)
                work = Path(work_dir) / label.split()[0]
                seconds = run(output, endpoint_url, staged, work, args.concurrency)
                print(
                    f"{label}: {args.files} x {args.size_mib} MiB = {total_mb:.0f} MB in {seconds:.1f} s "
                    f"-> {total_mb / seconds:.0f} MB/s (concurrency {args.concurrency})"
                )


if __name__ == "__main__":
    main()
