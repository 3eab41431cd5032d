"""The output's bookkeeping: the claim (``hsextract/job.json``), the job files (the plan, ``RunInfo``, the sample ids,
the data report) and one completion record per batch file."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from hsextract.errors import HsextractError
from hsextract.output.batch import StateLayout, header_checksum
from hsextract.output.manifest import STORED_FIELDS
from hsextract.storage.fileio import load_json, write_json
from hsextract.validation import parse, seal, unseal

JOB = "hsextract/job.json"


JOB_FILES = {
    "plan": "hsextract/plan.json",
    "info": "hsextract/run.json",
    "samples": "hsextract/sample_ids.json",
    "data_report": "hsextract/data_report.json",
}

"""What any node, or ``hsextract finalize``, needs to finish the output without a run dir (finalize.py)."""


DONE_PREFIX = "hsextract/done/"


# -- the claim ------------------------------------------------------------------------------------------------------
def job_record(*, plan, nodes: int, run_dir: str, host: str) -> dict:
    """The claim, sealed (validation.seal): an edit of it is seen, and it vouches for the job files beside it."""
    return seal(
        {
            "plan_hash": plan.plan_hash,
            "shards": plan.shards,
            "nodes": nodes,
            "fingerprint": plan.fingerprint,
            "started_by": {"run_dir": run_dir, "host": host, "time": time.time()},
        }
    )


def read_job(sink) -> dict | None:
    """The output's claim (its checksum checked), or None if it has none; a damaged one raises, naming it. A claim
    without a checksum is an older hsextract's."""
    try:
        raw = sink.get_bytes(JOB)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raw = b"(a directory)"

    def damaged(problem) -> HsextractError:
        return HsextractError(
            f"{sink.url}/{JOB} (the output's claim) is damaged ({problem}): nothing was changed; restore it, or "
            "delete it only if no run writes there"
        )

    try:
        job = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise damaged(e) from None
    if not isinstance(unseal(job, damaged, required=False).get("plan_hash"), str):
        raise damaged("no plan_hash string")
    return job


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


def forget_job(sink) -> None:
    """Every completion record, the job files and the claim removed: the output belongs to no job (--restart)."""
    for key in sink.list_keys(DONE_PREFIX):
        sink.delete(key)
    for key in JOB_FILES.values():
        sink.delete(key)
    sink.delete(JOB)


def job_file_bytes(name: str, value) -> bytes:
    """A job file's bytes as published: the dict records sealed (validation.seal), the plan as it is (its
    ``plan_hash`` proves it), the sample ids as a plain list (their sha256 is in the sealed run info)."""
    if name == "data_report":
        value = seal(value)
    return value if isinstance(value, bytes) else json.dumps(value).encode()


def publish_job_files(sink, files: dict[str, object]) -> None:
    """Put the job files next to the claim, each only if absent: every node of a job computes the same ones. One
    already there that differs from this node's is refused by name, touching nothing: the claim says the job is
    this plan's, so that file was edited or damaged."""
    for name, value in files.items():
        body = job_file_bytes(name, value)
        if sink.put_bytes_if_absent(JOB_FILES[name], body):
            continue
        try:
            held = sink.get_bytes(JOB_FILES[name])
        except (FileNotFoundError, IsADirectoryError):
            held = None
        if held != body and not _same_json(held, body):
            raise HsextractError(
                f"{sink.url}/{JOB_FILES[name]} differs from what this job's preparation makes of the same data "
                "and plan (edited or damaged): nothing was changed; delete that file and rerun (it is published "
                "again from the data), or rerun with --restart"
            )


def _same_json(a: bytes | None, b: bytes) -> bool:
    """The same JSON value; one published by an hsextract that sealed nothing is compared without the seal and
    what came with it."""
    try:
        old, new = json.loads(a), json.loads(b)
    except (TypeError, ValueError):
        return False
    if isinstance(old, dict) and isinstance(new, dict) and "checksum" not in old:
        new = {k: v for k, v in new.items() if k not in ("checksum", "sample_ids_sha256")}
    return old == new


def sample_ids_checksum(raw: bytes) -> str:
    """The sha256 of ``sample_ids.json``'s bytes, recorded in the sealed run info."""
    import hashlib

    return "sha256:" + hashlib.sha256(raw).hexdigest()


# -- completion records ---------------------------------------------------------------------------------------------
def done_key(key: str) -> str:
    return f"{DONE_PREFIX}{key}.json"


def stored_record(stored, output_url: str, head: bytes | None) -> dict:
    """What the uploader records of a batch file it made durable (``write_done`` adds the plan hash): size and
    CRC32 of the file, size and checksum of its header (``STORED_FIELDS``, copied into the manifest). ``head``
    is None for a staged file without a readable header: the manifest is then refused."""
    record = {"key": stored.key, "size": stored.size, "crc32": f"{stored.crc32:08x}", "output": output_url}
    if head is not None:
        record.update(header_size=len(head), header_xxh3=header_checksum(head))
    return record


def write_done(sink, record: dict, plan_hash: str) -> None:
    """Record a verified batch in the output. Deterministic content (no output URL, no time): a recomputed batch
    writes the same bytes."""
    done = seal({**{k: v for k, v in record.items() if k != "output"}, "plan_hash": plan_hash})
    sink.put_bytes(done_key(record["key"]), json.dumps(done, sort_keys=True).encode())


def read_done(sink, key: str) -> dict | None:
    """The completion record of batch ``key``; None if there is none or it does not prove itself."""
    record, _problem = read_done_checked(sink, key)
    return record


def read_done_checked(sink, key: str) -> tuple[dict | None, str | None]:
    """The completion record of batch ``key`` (its checksum checked and removed), or None and why: ``None`` when
    there is none, else what is wrong with it. A record without a checksum is an older hsextract's."""
    try:
        record = json.loads(sink.get_bytes(done_key(key)))
    except FileNotFoundError:
        return None, None
    except IsADirectoryError:
        return None, "its completion record is a directory"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, "its completion record is not JSON"
    try:
        return unseal(record, ValueError, required=False), None
    except ValueError as e:
        return None, f"its completion record is damaged ({e})"


def done_in_output(sink, prefix: str = "") -> set[str]:
    """Batch keys with a completion record in the output (one listing; ``prefix`` e.g. ``shard-00003/``)."""
    return {
        k[len(DONE_PREFIX) : -len(".json")]
        for k in sink.list_keys(DONE_PREFIX + prefix)
        if k.endswith(".json")
    }


def check_batches(
    sink, keys, plan_hash: str, workers: int = 16, *, full: bool = False
) -> tuple[dict[str, str], dict[str, dict]]:
    """For each batch key: its completion record exists, matches this plan, records the file's checksums, and the
    object is there with the recorded size and CRC32: the one the store keeps, or with ``full`` (before a
    manifest) computed from the bytes where it keeps none (a local output). Returns ``{key: what is wrong}`` for
    the bad ones and the records of the good ones."""
    records: dict[str, dict] = {}

    def check(key: str) -> str | None:
        record, damaged = read_done_checked(sink, key)
        if record is None:
            return damaged or "no completion record"
        if not all(isinstance(record.get(f), t) for f, t in STORED_FIELDS.items()):
            return (
                "its completion record lacks the file's checksums (a staged file without a readable header?)"
            )
        records[key] = record
        if record.get("plan_hash") != plan_hash:
            return f"completion record of another plan ({record.get('plan_hash')})"
        stored = sink.checksum(key) if full else sink.stored(key)
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


def verified_done(sink, prefix: str, keys, plan_hash: str) -> tuple[dict[str, dict], dict[str, str]]:
    """Of the batch ``keys`` under ``prefix``, those the output records done for this plan and bears out (record
    and object, ``check_batches``), with their records; and why each other one recorded is not done."""
    recorded = [k for k in done_in_output(sink, prefix) if k in keys]
    problems, records = check_batches(sink, recorded, plan_hash) if recorded else ({}, {})
    return records, problems


# -- what preparation learned (a job file: hsextract/run.json, and run.json in the run dir) -------------------------
@dataclass(kw_only=True, frozen=True)
class RunInfo:
    """What preparation learned about the run, written to ``run.json`` for the workers, warm-up and manifest."""

    layer_ids: tuple[int, ...]
    """Captured decoder-layer ids (output of layer k), sorted."""
    layer_types: tuple[str, ...]
    """The architecture's type of each captured layer (``linear_attention``, ``full_attention``...)."""
    num_layers: int
    hidden_size: int
    pad_token_id: int
    plan_hash: str
    file_metadata: dict
    """Run-wide string metadata every batch file carries (output/batch.py builds it)."""
    final_state: bool = False
    """The last decoder layer's output is stored too (``--final-state``)."""
    storage_dtype: str | None = None
    """``float8_e4m3fn``, or None: states stored in the run dtype."""
    vocab_size: int | None = None
    """The target's vocabulary size (exports of draft-vocabulary mappings need it)."""
    presets: dict = field(default_factory=dict)
    """Each preset the layers name -> its layer ids (layers.py); empty for explicit ids."""
    target_topk: int | None = None
    """K of the target's top-k stored beside the states (``--target-topk``), or None."""
    sample_ids_sha256: str | None = None
    """The sha256 of the output's ``hsextract/sample_ids.json`` (``sample_ids_checksum``): the list proves itself
    through this sealed record."""

    @property
    def layout(self):
        """What the run's batch files hold, slot by slot (output.StateLayout)."""
        return StateLayout(
            self.layer_ids, self.num_layers, self.final_state, self.storage_dtype, self.target_topk
        )

    def to_json(self) -> dict:
        """Every field, sealed (validation.seal); ``target_topk`` and ``sample_ids_sha256`` only when set."""
        d = asdict(self)
        for optional in ("target_topk", "sample_ids_sha256"):
            if d[optional] is None:
                del d[optional]
        return seal(d)

    def save(self, run_dir) -> None:
        write_json(run_dir.info_file, self.to_json())

    @classmethod
    def load(cls, run_dir) -> RunInfo:
        return cls.from_json(
            load_json(run_dir.info_file, "what preparation learned"), where=str(run_dir.info_file)
        )

    @classmethod
    def from_json(cls, d: dict, where: str = "run.json") -> RunInfo:
        """Its checksum checked (one without is an older hsextract's), then every field, strictly: sizes and counts
        positive, layer ids in range and sorted, one type per layer id."""

        def damaged(problems) -> HsextractError:
            return HsextractError(
                f"{where} is damaged ({problems}): nothing was changed; rerun with --restart to prepare it again"
            )

        body = {k: v for k, v in d.items() if k != "checksum"} if isinstance(d, dict) else d
        info = parse(cls, body, damaged)  # first: a wrong type is named by its field
        unseal(d, damaged, required=False)
        if problem := info._problem():
            raise damaged(problem)
        return info

    def _problem(self) -> str | None:
        if self.num_layers < 1 or self.hidden_size < 1:
            return f"num_layers {self.num_layers}, hidden_size {self.hidden_size}: both must be positive"
        if list(self.layer_ids) != sorted(set(self.layer_ids)) or not all(
            0 <= k < self.num_layers for k in self.layer_ids
        ):
            return f"layer_ids {list(self.layer_ids)} are not sorted distinct ids of {self.num_layers} layers"
        if len(self.layer_types) != len(self.layer_ids):
            return f"{len(self.layer_types)} layer_types for {len(self.layer_ids)} layer_ids"
        for name, value in (("vocab_size", self.vocab_size), ("target_topk", self.target_topk)):
            if value is not None and value < 1:
                return f"{name} {value} is not positive"
        if self.pad_token_id < 0 or (self.vocab_size is not None and self.pad_token_id >= self.vocab_size):
            return f"pad_token_id {self.pad_token_id} is not an id of the vocabulary ({self.vocab_size})"
        return None
