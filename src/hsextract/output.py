"""The output format: what a batch file's metadata says, and the manifest that makes an output complete.

An output (a local directory or ``s3://bucket/prefix``) holds:

- ``shard-SSSSS/batch-BBBBBB.safetensors``: one file per batch (key format in rundir.py, bytes by writer.py);
- ``hsextract/job.json``: the claim. Created only if absent (a conditional put on S3), before any batch is
  written; it names the job (plan hash, fingerprint, shards, nodes) and who started it. A run whose plan differs is
  refused, and every uploader checks it before each upload, so two jobs can never mix in one output;
- ``hsextract/plan.json``, ``run.json``, ``sample_ids.json``, ``data_report.json``: what finishing the output
  needs, so that any node, or ``hsextract finalize OUTPUT``, can write the manifest without a run dir;
- ``hsextract/done/<batch key>.json``: one completion record per durable batch (size, CRC32), written by the
  uploader after the upload is verified. Progress and completion are visible from the output alone;
- ``manifest.json``: written last, once every planned batch has a completion record AND its object was checked to
  exist with that size and checksum: an output with a manifest is complete. docs/FORMAT.md describes it all.

Each batch file carries run-wide metadata (layer ids and their convention, model, dtype, tokenizer and plan
hashes) and its own identity (batch id, shard, sample ids), so a file read alone still says what it holds. The
manifest lists every batch with its sample ids in plan order; the reader maps sample ids to files through it.

Integrity (format 2): every batch file's metadata holds one checksum per sample, over that sample's rows of every
per-token tensor, and one over the index tensors (``checksums``, built by writer.py in the writer thread from the
tensors it is about to write). The uploader records each file's size, CRC32 and header checksum in its marker, and
the manifest copies them per batch. So a reader checks a file's header against the manifest when it opens the
file and a sample against its own checksum when it reads it (one ranged read still fetches one sample), and
``hsextract verify`` (verify.py) checks whole files. xxh3_64 runs at 5-11 GB/s on one core, 3-4 times zlib's
CRC32; docs/PERFORMANCE.md has the measured costs.

A file's ``hidden_states`` tensor is ``[tokens, slots, hidden]`` (``StateLayout``): one slot per captured layer in
id order, then, with the final state, one for the last decoder layer's output unless that layer is captured
already. With fp8 storage, ``hidden_states_scale`` [tokens, slots] float32 follows it. With the final state, the
output also holds ``final_norm.safetensors`` (the norm's weight; its epsilon and rule in the metadata), written by
the workers once the model is loaded and named in the manifest.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from . import __version__
from .errors import CorruptOutputError, HsextractError
from .storage import check_key

MANIFEST = "manifest.json"
JOB = "hsextract/job.json"
JOB_FILES = {
    "plan": "hsextract/plan.json",
    "info": "hsextract/run.json",
    "samples": "hsextract/sample_ids.json",
    "data_report": "hsextract/data_report.json",
}
"""What any node, or ``hsextract finalize``, needs to finish the output without a run dir (finalize.py)."""
DONE_PREFIX = "hsextract/done/"
FINAL_NORM = "final_norm.safetensors"
BATCH_FORMAT = "hsextract-batch"
BATCH_FORMAT_VERSION = "3"
"""2: per-sample and index checksums in the metadata (``checksums``). 3: ``hidden_states`` holds slots (the
final state after the captured layers), fp8 values come with ``hidden_states_scale``; ``slot_layer_ids``,
``final_state_slot`` and ``storage_dtype`` in the metadata."""
OUTPUT_FORMAT = "hsextract-output"
OUTPUT_FORMAT_VERSION = 3
"""2: each batch's size, CRC32 and header checksum in the manifest. 3: the state layout (``slot_layer_ids``,
``final_state``, ``storage_dtype``), ``num_layers`` and ``vocab_size``."""

INDEX_TENSORS = ("cu_seqlens", "sample_index")
"""A batch file's per-batch tensors; every other tensor is per-token (its first dimension is the token count)."""
CHECKSUMS = "checksums"
"""The metadata key of a batch file's checksums (a JSON object, see ``checksums_metadata``)."""
CHECKSUM_ALGORITHM = "xxh3_64"
CHECKSUM_CHUNK = 8 << 20
"""Bytes hashed per call: xxhash holds the GIL while it hashes, and the writer thread must not starve the
thread that launches the GPU's kernels (8 MiB is about a millisecond)."""
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000
"""The largest header a batch file may declare (the safetensors library's own limit)."""
CONVENTION = "output_of_decoder_layer"
"""Layer id k is the OUTPUT of decoder layer k (0-based), before the final norm: HF output_hidden_states[k + 1]."""


@dataclass(frozen=True)
class StateLayout:
    """What the ``hidden_states`` tensor of every batch file holds, slot by slot, and how its values are stored."""

    layer_ids: tuple[int, ...]
    """The captured decoder-layer ids, sorted."""
    num_layers: int
    final_state: bool = False
    """Whether the last decoder layer's output (before the final norm) is stored too."""
    storage_dtype: str | None = None
    """``float8_e4m3fn`` (values with a float32 scale per token per slot), or None: the run dtype."""

    @property
    def slot_layers(self) -> tuple[int, ...]:
        """The decoder layer whose output each slot holds."""
        last = self.num_layers - 1
        extra = (last,) if self.final_state and last not in self.layer_ids else ()
        return tuple(self.layer_ids) + extra

    @property
    def final_slot(self) -> int | None:
        return self.slot_layers.index(self.num_layers - 1) if self.final_state else None

    @property
    def scaled(self) -> bool:
        return self.storage_dtype is not None

    def bytes_per_token(self, hidden: int, itemsize: int) -> int:
        """Stored bytes per token: the states (``itemsize`` bytes a value unless fp8), their scales, id and mask."""
        if self.scaled:
            return bytes_per_token(len(self.slot_layers), hidden, 1, scale_bytes=4)
        return bytes_per_token(len(self.slot_layers), hidden, itemsize)

    def file_metadata(self) -> dict[str, str]:
        return {
            "slot_layer_ids": json.dumps(list(self.slot_layers)),
            "final_state_slot": "" if self.final_slot is None else str(self.final_slot),
            "storage_dtype": self.storage_dtype or "",
        }

    @classmethod
    def from_manifest(cls, manifest: dict) -> StateLayout:
        """The layout a manifest describes; version 1 outputs hold the captured layers only, unscaled."""
        ids = tuple(manifest["layer_ids"])
        return cls(
            ids,
            manifest.get("num_layers") or max(ids) + 1,
            bool(manifest.get("final_state")),
            manifest.get("storage_dtype"),
        )


def run_file_metadata(
    *,
    layout: StateLayout,
    model: str,
    model_revision: str,
    model_config_hash: str,
    dtype: str,
    hidden_size: int,
    tokenizer_hash: str,
    chat_template_hash: str,
    plan_hash: str,
    kernels: str,
) -> dict[str, str]:
    """The run-wide part of every batch file's metadata."""
    layer_ids = layout.layer_ids
    return {
        "layer_ids": json.dumps(list(layer_ids)),
        "layer_convention": CONVENTION,
        "hf_output_hidden_states_index": json.dumps([k + 1 for k in layer_ids]),
        "pre_final_norm": "true",
        **layout.file_metadata(),
        "model": model,
        "model_revision": model_revision,
        "model_config_hash": model_config_hash,
        "dtype": dtype,
        "hidden_size": str(hidden_size),
        "tokenizer_hash": tokenizer_hash,
        "chat_template_hash": chat_template_hash,
        "plan_hash": plan_hash,
        "kernels": kernels,
        "hsextract_version": __version__,
    }


def batch_metadata(*, run_meta: dict, batch_id: int, shard: int, sample_ids: list[str]) -> dict[str, str]:
    """The per-file metadata: run-wide fields plus this batch's identity."""
    meta = {k: str(v) for k, v in run_meta.items()}
    meta.update(
        format=BATCH_FORMAT,
        format_version=BATCH_FORMAT_VERSION,
        batch_id=str(batch_id),
        shard=str(shard),
        sample_ids=json.dumps(sample_ids),
    )
    return meta


def new_checksum() -> xxhash.xxh3_64:
    """A running checksum of the kind every hsextract checksum is (``update``, then ``hexdigest``: 16 hex)."""
    return xxhash.xxh3_64()


def update_checksum(checksum: xxhash.xxh3_64, data) -> None:
    """Feed ``data`` (any contiguous buffer) in ``CHECKSUM_CHUNK`` pieces, letting other threads run between."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), CHECKSUM_CHUNK):
        checksum.update(view[start : start + CHECKSUM_CHUNK])


def checksum_order(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """A batch file's tensor names as (per-token, index), each in name order: the order of the tensors in the file
    and the order in which a sample's checksum covers its rows of the per-token tensors."""
    names = sorted(names)
    return [n for n in names if n not in INDEX_TENSORS], [n for n in names if n in INDEX_TENSORS]


def checksums_metadata(
    *, per_token: list[str], samples: list[str], index_tensors: list[str], index: str
) -> dict[str, str]:
    """The ``checksums`` metadata entry: per sample, a checksum of its rows of the ``per_token`` tensors (in that
    order); one checksum of the ``index_tensors`` (whole, in that order)."""
    value = {
        "algorithm": CHECKSUM_ALGORITHM,
        "per_token_tensors": per_token,
        "samples": samples,
        "index_tensors": index_tensors,
        "index": index,
    }
    return {CHECKSUMS: json.dumps(value, separators=(",", ":"))}


def header_checksum(head: bytes) -> str:
    """The checksum of a batch file's header bytes (the 8-byte length and the JSON), as the manifest records it."""
    checksum = new_checksum()
    checksum.update(head)
    return checksum.hexdigest()


def read_file_head(path: str | Path) -> bytes:
    """The header bytes (8-byte length + JSON) of a local batch file; ``HsextractError`` if it has none."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_LENGTH_BYTES)
        if len(raw) < HEADER_LENGTH_BYTES:
            raise HsextractError(f"{path} has no safetensors header ({len(raw)} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise HsextractError(f"{path} declares a header of {n} bytes, over the {MAX_HEADER_BYTES} cap")
        raw += f.read(n)
    if len(raw) < HEADER_LENGTH_BYTES + n:
        raise HsextractError(f"{path} ends inside its header ({len(raw)} of {HEADER_LENGTH_BYTES + n} bytes)")
    return raw


def bytes_per_token(num_slots: int, hidden: int, itemsize: int, scale_bytes: int = 0) -> int:
    """States of every slot (and their scales), plus the token id (int32) and its loss-mask byte."""
    return num_slots * (hidden * itemsize + scale_bytes) + 4 + 1


def estimate_file_bytes(num_tokens: int, num_samples: int, token_bytes: int) -> int:
    """Bytes of a batch file's tensors for ``token_bytes`` per token (the header adds a few KB)."""
    return num_tokens * token_bytes + (num_samples + 1) * 8 + num_samples * 8


STORED_FIELDS = {"size": int, "crc32": str, "header_size": int, "header_xxh3": str}
"""What the manifest records of each batch file, copied from the uploader's marker."""


def build_manifest(
    *,
    info,
    plan,
    dtype: str,
    sample_ids: list[str],
    data_report: dict,
    stored: dict[str, dict],
    final_norm: dict | None = None,
) -> dict:
    """The manifest of a finished run: run-wide facts and every batch with its sample ids, in plan order.

    ``stored`` maps each batch key to what the uploader recorded of the file in its marker: ``size``, ``crc32``
    (8 hex), ``header_size`` and ``header_xxh3`` (the checksum of its first ``header_size`` bytes). ``final_norm`` is
    what ``read_final_norm_meta`` found in the output (with the final state only)."""
    layout = info.layout
    final = None
    if layout.final_state:
        final = {"slot": layout.final_slot, "layer": layout.num_layers - 1, "norm": final_norm}
    return {
        "format": OUTPUT_FORMAT,
        "format_version": OUTPUT_FORMAT_VERSION,
        "hsextract_version": __version__,
        "layer_ids": list(info.layer_ids),
        "layer_convention": CONVENTION,
        "layer_types": list(info.layer_types),
        "num_layers": info.num_layers,
        "slot_layer_ids": list(layout.slot_layers),
        "final_state": final,
        "storage_dtype": layout.storage_dtype,
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "dtype": dtype,
        "plan_hash": plan.plan_hash,
        "fingerprint": plan.fingerprint,
        "num_samples": plan.num_samples,
        "num_tokens": plan.num_tokens,
        "data_report": data_report,
        "batches": [
            {
                "key": b.key,
                "batch_id": b.batch_id,
                "shard": b.shard,
                "num_tokens": b.num_tokens,
                "sample_ids": [sample_ids[i] for i in b.sample_indices],
                **{field: stored[b.key][field] for field in STORED_FIELDS},
            }
            for b in plan.batches
        ],
    }


def read_final_norm_meta(sink) -> dict:
    """The final norm's description (key, epsilon, rule, dtype) from ``final_norm.safetensors``, with the file's
    ``size`` and ``xxh3`` that the manifest records (the file is one vector: read whole); read without torch; a
    clear error if no worker wrote it."""
    if not sink.exists(FINAL_NORM):
        raise HsextractError(
            f"{sink.url} has no {FINAL_NORM}, which every worker of a --final-state run writes when it loads the "
            "model: rerun the same command to let a worker write it"
        )
    data = sink.get_bytes(FINAL_NORM)
    return {"key": FINAL_NORM, **describe_final_norm(sink, data), "size": len(data), "xxh3": _xxh3(data)}


def describe_final_norm(sink, data: bytes) -> dict:
    """Epsilon, rule and dtype from the header metadata of ``final_norm.safetensors`` as read (``data``)."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + n]).get("__metadata__", {})
        return {"eps": float(meta["eps"]), "rule": meta["rule"], "dtype": meta["dtype"]}
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptOutputError(sink.url, FINAL_NORM, f"is not a final norm hsextract wrote ({e})") from None


def read_checked_final_norm(sink, recorded: dict, *, verify: bool = True) -> bytes:
    """The bytes of ``final_norm.safetensors``; with ``verify``, ``CorruptOutputError`` unless they are the file
    the manifest recorded in ``recorded`` (its ``final_state.norm``; manifests from before the checksum record
    none, and are not checked). A missing file is a ``CorruptOutputError`` either way."""
    try:
        data = sink.get_bytes(recorded["key"])
    except FileNotFoundError:
        raise CorruptOutputError(
            sink.url, recorded["key"], "does not exist (listed in the manifest)"
        ) from None
    if verify and "xxh3" in recorded:
        got = _xxh3(data)
        if len(data) != recorded["size"] or got != recorded["xxh3"]:
            raise CorruptOutputError(
                sink.url,
                recorded["key"],
                f"is {len(data)} bytes with checksum {got}; the manifest recorded {recorded['size']} bytes with "
                f"checksum {recorded['xxh3']}: it was altered or replaced after the run",
            )
    return data


def _xxh3(data: bytes) -> str:
    checksum = new_checksum()
    update_checksum(checksum, data)
    return checksum.hexdigest()


def write_manifest(sink, manifest: dict) -> None:
    sink.put_bytes(MANIFEST, json.dumps(manifest).encode())


def has_manifest(sink) -> bool:
    return sink.exists(MANIFEST)


def delete_manifest(sink) -> None:
    sink.delete(MANIFEST)


def read_manifest(sink) -> dict:
    """The manifest of the output behind ``sink``, its structure checked: ``HsextractError`` if there is none,
    ``CorruptOutputError`` naming it if it is unreadable or lacks what a reader relies on."""
    if not sink.exists(MANIFEST):
        raise HsextractError(
            f"{sink.url} has no {MANIFEST}: the run has not finished (see `hsextract status RUN_DIR`) "
            "or this is not an hsextract output"
        )

    def damaged(problem: str) -> CorruptOutputError:
        return CorruptOutputError(sink.url, MANIFEST, f"{problem}; the output is damaged")

    try:
        manifest = json.loads(sink.get_bytes(MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise damaged(f"is not valid JSON ({e})") from None
    except FileNotFoundError:
        raise damaged("disappeared while being read") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("batches"), list):
        raise damaged("has no batch list")
    version = manifest.get("format_version")
    if manifest.get("format") != OUTPUT_FORMAT or not isinstance(version, int):
        raise damaged(
            f"is not an {OUTPUT_FORMAT} manifest (format {manifest.get('format')!r}, version {version!r})"
        )
    if version > OUTPUT_FORMAT_VERSION:
        raise HsextractError(
            f"{sink.url}/{MANIFEST} has format version {version}; this hsextract ({__version__}) reads up to "
            f"{OUTPUT_FORMAT_VERSION}: upgrade hsextract"
        )
    layer_ids = manifest.get("layer_ids")
    if not isinstance(layer_ids, list) or not all(isinstance(k, int) for k in layer_ids):
        raise damaged("has no list of layer ids")
    for i, batch in enumerate(manifest["batches"]):
        if not (
            isinstance(batch, dict)
            and isinstance(batch.get("key"), str)
            and isinstance(batch.get("sample_ids"), list)
            and all(isinstance(sid, str) for sid in batch["sample_ids"])
        ):
            raise damaged(f"batch entry {i} has no key or no sample ids")
        try:
            check_key(batch["key"])
        except ValueError:
            raise damaged(
                f"batch entry {i} has the key {batch['key']!r}, not a path inside the output"
            ) from None
        if version >= 2 and not all(isinstance(batch.get(f), t) for f, t in STORED_FIELDS.items()):
            raise damaged(f"batch entry {i} ({batch['key']}) lacks its size or checksums")
    return manifest


# -- the claim ------------------------------------------------------------------------------------------------------
def job_record(*, plan, nodes: int, run_dir: str, host: str) -> dict:
    return {
        "plan_hash": plan.plan_hash,
        "shards": plan.shards,
        "nodes": nodes,
        "fingerprint": plan.fingerprint,
        "started_by": {"run_dir": run_dir, "host": host, "time": time.time()},
    }


def read_job(sink) -> dict | None:
    try:
        return json.loads(sink.get_bytes(JOB))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HsextractError(
            f"{sink.url}/{JOB} is damaged ({e}); delete it only if no run writes there"
        ) from None


def claim_output(sink, job: dict) -> dict:
    """Make ``job`` the output's job if it has none (atomically: of two racing runs exactly one wins); returns
    the job in force, which the caller compares with its own."""
    if sink.put_bytes_if_absent(JOB, json.dumps(job, indent=2).encode()):
        return job
    held = read_job(sink)
    if held is None:  # deleted between our attempt and the read: try once more
        return (
            job if sink.put_bytes_if_absent(JOB, json.dumps(job, indent=2).encode()) else read_job(sink) or {}
        )
    return held


def describe_job(job: dict) -> str:
    who = job.get("started_by", {})
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(who.get("time", 0)))
    return f"plan {job.get('plan_hash')}, started from run dir {who.get('run_dir')} on {who.get('host')} at {when}"


def check_claim(sink, plan_hash: str) -> None:
    """Raise unless the output is still claimed by the job with ``plan_hash`` (uploaders call it per file)."""
    job = read_job(sink)
    if job is None or job.get("plan_hash") != plan_hash:
        held = "no job at all" if job is None else f"another job ({describe_job(job)})"
        raise HsextractError(
            f"output {sink.url} is now held by {held}, not this run's plan {plan_hash}: stopped so that two jobs "
            "never mix in one output"
        )


def publish_job_files(sink, files: dict[str, object]) -> None:
    """Put the job files next to the claim, each only if absent: every node of a job computes the same ones."""
    for name, value in files.items():
        sink.put_bytes_if_absent(JOB_FILES[name], json.dumps(value).encode())


# -- completion records ---------------------------------------------------------------------------------------------
def done_key(key: str) -> str:
    return f"{DONE_PREFIX}{key}.json"


def stored_record(stored, output_url: str, head: bytes | None) -> dict:
    """What the uploader records of a batch file it made durable (its marker; its completion record adds the plan
    hash): size and CRC32 of the file, size and checksum of its header (``STORED_FIELDS``, copied into the
    manifest). ``head`` is None for a staged file without a readable header: the manifest is then refused."""
    record = {"key": stored.key, "size": stored.size, "crc32": f"{stored.crc32:08x}", "output": output_url}
    if head is not None:
        record.update(header_size=len(head), header_xxh3=header_checksum(head))
    return record


def write_done(sink, record: dict, plan_hash: str) -> None:
    """Record a verified batch in the output. Deterministic content (no output URL, no time): a recomputed batch
    writes the same bytes."""
    done = {**{k: v for k, v in record.items() if k != "output"}, "plan_hash": plan_hash}
    sink.put_bytes(done_key(record["key"]), json.dumps(done, sort_keys=True).encode())


def read_done(sink, key: str) -> dict | None:
    """The completion record of batch ``key``; None if there is none or it is unreadable."""
    try:
        record = json.loads(sink.get_bytes(done_key(key)))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def done_in_output(sink, prefix: str = "") -> set[str]:
    """Batch keys with a completion record in the output (one listing; ``prefix`` e.g. ``shard-00003/``)."""
    return {
        k[len(DONE_PREFIX) : -len(".json")]
        for k in sink.list_keys(DONE_PREFIX + prefix)
        if k.endswith(".json")
    }


def check_batches(sink, keys, plan_hash: str, workers: int = 16) -> tuple[dict[str, str], dict[str, dict]]:
    """For each batch key: its completion record exists, matches this plan, records the file's checksums, and the
    object is there with the recorded size and (where the store keeps one) CRC32. Returns ``{key: what is
    wrong}`` for the bad ones and the records of the good ones."""
    records: dict[str, dict] = {}

    def check(key: str) -> str | None:
        record = read_done(sink, key)
        if record is None:
            return "no completion record"
        if not all(isinstance(record.get(f), t) for f, t in STORED_FIELDS.items()):
            return (
                "its completion record lacks the file's checksums (a staged file without a readable header?)"
            )
        records[key] = record
        if record.get("plan_hash") != plan_hash:
            return f"completion record of another plan ({record.get('plan_hash')})"
        stored = sink.stored(key)
        if stored is None:
            return "batch file missing"
        if stored.size != record["size"]:
            return f"batch file has {stored.size} bytes, {record['size']} were uploaded"
        if stored.crc32 is not None and f"{stored.crc32:08x}" != record["crc32"]:
            return f"batch file CRC32 {stored.crc32:08x}, {record['crc32']} was uploaded"
        return None

    keys = list(keys)
    with ThreadPoolExecutor(max(1, min(workers, len(keys)))) as pool:
        problems = dict(zip(keys, pool.map(check, keys), strict=True))
    bad = {k: v for k, v in problems.items() if v}
    return bad, {k: r for k, r in records.items() if k not in bad}
