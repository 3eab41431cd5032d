"""The job files of an output (``hsextract/plan.json``, ``run.json``, ``sample_ids.json``, ``data_report.json``), read
back for finalize, verify and status. Each proves itself: the plan by its own hash, the dict records by their
checksum (validation.seal), the sample ids by the checksum the sealed run info records of them; and they agree with
the claim (``hsextract/job.json``) and with each other. One that does not is refused by name and nothing is
touched: when a job file and the batch files disagree, the job file is the suspect (finalize.py)."""

from __future__ import annotations

import json

from hsextract.errors import HsextractError
from hsextract.output.plan import Plan
from hsextract.output.records import JOB, JOB_FILES, RunInfo, read_job, sample_ids_checksum
from hsextract.validation import unseal


def load_job_files(sink) -> tuple[Plan, RunInfo, list[str], dict]:
    """The job files, each proving itself (validation.seal; the plan by its own hash) and agreeing with the claim
    and with each other; one that does not is refused by name (``suspect``), nothing touched."""
    plan, info, sealed = _plan_and_info(sink)
    raw = _job_bytes(sink, "samples")
    try:
        sample_ids = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise suspect(sink, "samples", f"is not JSON ({e})") from None
    if info.sample_ids_sha256 is not None and sample_ids_checksum(raw) != info.sample_ids_sha256:
        raise suspect(sink, "samples", f"does not match the checksum {JOB_FILES['info']} records for it")
    if sealed and info.sample_ids_sha256 is None:
        raise suspect(sink, "info", "records no checksum of the sample ids")
    if not (isinstance(sample_ids, list) and all(isinstance(i, str) for i in sample_ids)):
        raise suspect(sink, "samples", "is not a list of sample ids (strings)")
    if len(sample_ids) != plan.num_samples or len(set(sample_ids)) != len(sample_ids):
        raise suspect(
            sink, "samples", f"holds {len(sample_ids)} ids, not the plan's {plan.num_samples} distinct"
        )
    report = _job_json(sink, "data_report")
    report = unseal(
        report, lambda problem: suspect(sink, "data_report", f"is damaged ({problem})"), required=sealed
    )
    return plan, info, sample_ids, report


def load_plan(sink) -> tuple[Plan, RunInfo]:
    """The job's plan and run info alone (status needs no sample ids, which grow with the job)."""
    plan, info, _sealed = _plan_and_info(sink)
    return plan, info


def _plan_and_info(sink) -> tuple[Plan, RunInfo, bool]:
    """The plan and run info, each proving itself and naming the claim's plan; and whether the claim is sealed
    (written by an hsextract that seals every job file, which each must then be)."""
    raw_plan = _job_json(sink, "plan")
    plan = Plan.from_json(raw_plan, where=f"{sink.url}/{JOB_FILES['plan']}")
    job = read_job(sink)
    sealed = job is not None and "checksum" in job
    if job is not None and job["plan_hash"] != plan.plan_hash:
        raise suspect(
            sink, "plan", f"is plan {plan.plan_hash}, but the output's claim ({JOB}) says {job['plan_hash']}"
        )
    if sealed and "plan_hash" not in raw_plan:
        raise suspect(sink, "plan", "records no plan_hash")
    raw_info = _job_json(sink, "info")
    info_sealed = isinstance(raw_info, dict) and "checksum" in raw_info
    if sealed and not info_sealed:
        raise suspect(sink, "info", "carries no checksum of its content")
    if info_sealed and job is not None and not sealed:
        raise suspect(sink, JOB, "carries no checksum of its content, while the job files beside it do")
    info = RunInfo.from_json(raw_info, where=f"{sink.url}/{JOB_FILES['info']}")
    if info.plan_hash != plan.plan_hash or list(info.layer_ids) != plan.fingerprint.get(
        "layer_ids", info.layer_ids
    ):
        raise suspect(
            sink, "info", f"is of plan {info.plan_hash} with layers {list(info.layer_ids)}, not the plan's"
        )
    return plan, info, sealed


def suspect(sink, name: str, problem: str) -> HsextractError:
    """A job file that does not prove itself or contradicts the claim: refused by name, nothing touched."""
    return HsextractError(
        f"{sink.url}/{JOB_FILES.get(name, name)} {problem}: that job file was edited or damaged; nothing was changed. "
        "Restore it (every node publishes the same), or rerun the job's command with --restart to start over"
    )


def _job_bytes(sink, name: str) -> bytes:
    try:
        return sink.get_bytes(JOB_FILES[name])
    except FileNotFoundError:
        raise HsextractError(
            f"{sink.url} has no {JOB_FILES[name]}: not an hsextract output, or its first node has not "
            "finished preparing yet"
        ) from None
    except IsADirectoryError:
        raise suspect(sink, name, "is a directory") from None


def _job_json(sink, name: str):
    try:
        return json.loads(_job_bytes(sink, name))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise suspect(sink, name, f"is damaged ({e})") from None
