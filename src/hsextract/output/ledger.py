"""The output's ledger: who holds it (the claim and the job files beside it), which batches are done (one completion
record each) and the manifest that finishes it. The run keeps it, status and a following trainer read it; the rest
of hsextract needs none of it and imports the output's face (``hsextract.output``) alone.

Loaded lazily (PEP 562) like the face: the uploader writes completion records and must load neither numpy nor torch.
"""

from __future__ import annotations

from hsextract import lazy_exports

_EXPORTS = {
    "JOB_FILES": "records",
    "RunInfo": "records",
    "STORED_FIELDS": "manifest",
    "check_claim": "records",
    "check_file": "verify",
    "claim_output": "records",
    "delete_manifest": "manifest",
    "describe_job": "records",
    "done_in_output": "records",
    "forget_job": "records",
    "has_manifest": "manifest",
    "job_record": "records",
    "live_manifest": "finalize",
    "load_plan": "jobfiles",
    "publish_job_files": "records",
    "read_done": "records",
    "read_job": "records",
    "ready_manifest": "finalize",
    "sample_ids_checksum": "records",
    "shard_name": "keys",
    "stored_record": "records",
    "verified_done": "records",
    "write_done": "records",
    "write_final_manifest": "finalize",
}

"""Each name of the ledger -> the module of the output package that defines it."""

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, home="hsextract.output")
