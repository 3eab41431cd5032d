"""``hsextract verify OUTPUT``: every batch file the manifest lists, checked whole, several files at once.

The reader checks the same things piecemeal as it reads; this checks everything once. Each file is read once, front
to back, each chunk feeding the file's CRC32 and the checksum of the sample its bytes belong to: this works because
the writer puts the per-token tensors first, in the order the sample checksums cover them.
"""

from __future__ import annotations

import json
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise

from hsextract.errors import CorruptOutputError
from hsextract.output.batch import new_checksum, update_checksum
from hsextract.output.batchfile import BatchFile
from hsextract.output.final_norm import read_checked_final_norm
from hsextract.output.jobfiles import load_job_files
from hsextract.output.manifest import MANIFEST, header_expectations, read_manifest, require_checksums
from hsextract.output.records import JOB_FILES
from hsextract.output.sample_index import check_sample_index
from hsextract.storage import open_sink
from hsextract.storage.base import Sink, removed_temps_note

CHUNK = 8 << 20

"""Bytes per ranged read: S3's advice for ranged GETs is 8-16 MB, and on a local disk larger reads were slower (a
fresh buffer per read; docs/PERFORMANCE.md, "Checksums")."""


@dataclass
class VerifyReport:
    """What ``verify_output`` found: the files checked, their bytes, and each bad file with its problem."""

    url: str
    files: int
    bytes: int
    bad: list[CorruptOutputError] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    """The files checked beside the batch files (counted in ``files``): ``the sample index``, ``the final norm``."""
    removed_temps: list[str] = field(default_factory=list)
    """Temporary files of writes that ended (a killed uploader's) found in the output and removed."""

    def lines(self) -> list[str]:
        """What the console shows before the verdict: each bad file, and the temporary files removed."""
        note = removed_temps_note(self.removed_temps)
        return [f"BAD {e}" for e in self.bad] + ([note] if note else [])

    def describe(self) -> str:
        """``3 batch files, the sample index and the final norm``."""
        n = self.files - len(self.others)
        parts = [f"{n} batch file{'s' if n != 1 else ''}", *self.others]
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]

    @property
    def ok(self) -> bool:
        return not self.bad

    def as_dict(self) -> dict:
        return {
            "output": self.url,
            "ok": self.ok,
            "files": self.files,
            "bytes": self.bytes,
            "bad": [
                {"key": e.key, "url": f"{e.url.rstrip('/')}/{e.key}", "problem": e.problem} for e in self.bad
            ],
            "removed_temps": self.removed_temps,
        }


def check_file(sink: Sink, entry: dict, progress=None, expect: dict | None = None) -> int:
    """Check one batch file against its manifest ``entry``; raise ``CorruptOutputError`` saying what is wrong,
    else return the CRC32 of the bytes checked. An entry with only ``key`` and ``size`` checks a file against
    itself: its header's checksums (a staged file).

    ``progress(n)``, if given, is called with the number of bytes read as the file is read."""
    key = entry["key"]

    def damaged(problem: str) -> CorruptOutputError:
        return CorruptOutputError(sink.url, key, problem)

    try:
        size = sink.size(key)
    except FileNotFoundError:
        raise damaged("does not exist (listed in the manifest)") from None
    if size != entry["size"]:
        raise damaged(f"has {size} bytes; the manifest recorded {entry['size']}")
    # Header, its checksum, structure, index tensors, and what the header says against the manifest.
    f = BatchFile(sink, key, entry, verify=True, expect=expect)
    h = f.header
    # Byte ranges of each sample's rows, in file order: (start, stop, row).
    segments = []
    for name in h.per_token:
        info = h.tensors[name]
        for row, (a, b) in enumerate(pairwise(f.cu_seqlens)):
            segments.append((info.start + a * info.row_bytes, info.start + b * info.row_bytes, row))
    if any(s2 < e1 for (_, e1, _), (s2, _, _) in pairwise(segments)):
        raise damaged(
            f"its per-token tensors {h.per_token} are not laid out in the order hsextract writes them"
        )
    checksums = [new_checksum() for _ in f.sample_ids]
    crc, pos, next_segment = 0, 0, 0
    while pos < size:
        chunk = sink.read_range(key, pos, min(CHUNK, size - pos))
        if not chunk:
            raise damaged(f"ended at byte {pos} while being read ({size} bytes listed a moment before)")
        view = memoryview(chunk)
        end = pos + len(chunk)
        crc = zlib.crc32(view, crc)
        while next_segment < len(segments) and segments[next_segment][0] < end:
            start, stop, row = segments[next_segment]
            lo, hi = max(start, pos), min(stop, end)
            if hi > lo:
                update_checksum(checksums[row], view[lo - pos : hi - pos])
            if stop > end:
                break
            next_segment += 1
        pos = end
        if progress is not None:
            progress(len(chunk))
    problems = []
    bad_rows = [row for row, c in enumerate(checksums) if c.hexdigest() != h.checksums.samples[row]]
    if bad_rows:
        named = ", ".join(f"{f.sample_ids[row]!r} (row {row})" for row in bad_rows[:3])
        more = f" and {len(bad_rows) - 3} more" if len(bad_rows) > 3 else ""
        problems.append(f"{len(bad_rows)} sample(s) do not match their checksums: {named}{more}")
    if entry.get("crc32") is not None and f"{crc:08x}" != entry["crc32"]:
        problems.append(f"its CRC32 is {crc:08x}; the manifest recorded {entry['crc32']}")
    if problems:
        raise damaged("; ".join(problems))
    return crc


def check_against_plan(sink: Sink, manifest: dict) -> None:
    """The manifest lists exactly the batches of the plan the output holds (``hsextract/plan.json``), in order,
    with their samples: a batch entry dropped, repeated or altered by hand is ``CorruptOutputError``. Outputs
    without a plan (older hsextract) are checked against their batch headers only."""
    if not sink.exists(JOB_FILES["plan"]):
        return
    plan, info, sample_ids, _report = load_job_files(sink)  # each proves itself, or is named

    def differs(problem: str) -> CorruptOutputError:
        return CorruptOutputError(
            sink.url, MANIFEST, f"{problem}; the manifest was edited or is another job's"
        )

    if manifest.get("plan_hash") != plan.plan_hash:
        raise differs(f"has plan {manifest.get('plan_hash')}, the output's plan is {plan.plan_hash}")
    model = json.loads(json.dumps(info.to_json()))  # the model's figures the run recorded (sealed), as JSON
    for name in ("vocab_size",):  # no batch header holds it (each holds the rest: checked file by file)
        if manifest.get(name) != model.get(name):
            raise differs(
                f"records {name} {manifest.get(name)!r:.60}, the output's run.json {model.get(name)!r:.60}"
            )
    listed = [b["key"] for b in manifest["batches"]]
    planned = [b.key for b in plan.batches]
    if listed != planned:
        missing = sorted(set(planned) - set(listed))
        extra = sorted(set(listed) - set(planned))
        raise differs(
            f"lists {len(listed)} batches, the plan {len(planned)}"
            + (f"; missing {missing[:3]}" if missing else "")
            + (f"; not planned {extra[:3]}" if extra else "")
        )
    for entry, batch in zip(manifest["batches"], plan.batches, strict=True):
        if entry["sample_ids"] != [sample_ids[i] for i in batch.sample_indices]:
            raise differs(f"lists other samples for {batch.key} than the plan")


def verify_output(
    output: str,
    endpoint_url: str | None = None,
    *,
    workers: int = 8,
    show_progress: bool = True,
    retry_deadline_s: float = 120,
) -> VerifyReport:
    """Check every batch file the manifest of ``output`` lists (``check_file``), ``workers`` at a time.

    A damaged or unreadable manifest raises ``CorruptOutputError``; an output that cannot be reached raises
    ``HsextractError``. Bad batch files are collected in the report, in manifest order."""
    sink = open_sink(output, endpoint_url, retry_deadline_s=retry_deadline_s, reading=True)
    manifest = read_manifest(sink)
    require_checksums(sink, manifest, "there is nothing to verify its files against")
    check_against_plan(sink, manifest)
    batches = manifest["batches"]
    report = VerifyReport(sink.url, len(batches), sum(b["size"] for b in batches))
    # A finished output: a temporary file in it is one that a killed write left (its writer gone, stale_tmp).
    report.removed_temps = sink.remove_stale_temps()
    from tqdm import tqdm

    with tqdm(
        total=report.bytes,
        desc="verify",
        unit="B",
        unit_scale=True,
        disable=not show_progress,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 30.0,
    ) as bar:

        def check(entry: dict) -> CorruptOutputError | None:
            try:
                check_file(sink, entry, progress=bar.update, expect=header_expectations(manifest, entry))
            except CorruptOutputError as e:
                return e
            return None

        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="verify") as pool:
            report.bad = [e for e in pool.map(check, batches) if e is not None]
    if manifest.get("sample_index"):
        report.files += 1
        report.others.append("the sample index")
        try:
            report.bytes += check_sample_index(sink, manifest)
        except CorruptOutputError as e:
            report.bad.append(e)
    final = manifest.get("final_state")
    if final and final.get("norm"):
        report.files += 1
        report.others.append("the final norm")
        try:
            report.bytes += len(read_checked_final_norm(sink, final["norm"]))
        except CorruptOutputError as e:
            report.bad.append(e)
    return report
