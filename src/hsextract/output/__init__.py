"""What an hsextract output is, written and read: batch files, completion records, manifest, sample index, the
reader, verify and finalize. The rest of hsextract (and a trainer) imports from here, never from the modules.

Loaded lazily (PEP 562): the uploader imports the records from here and must not load torch with the reader. A
name is public once it is in ``_EXPORTS``; tests/unit/test_layout.py checks that the rest imports from here only.
"""

from __future__ import annotations

from hsextract import lazy_exports

_EXPORTS = {
    "BatchFile": "batchfile",
    "BatchSpec": "plan",
    "CONVENTION": "batch",
    "DONE_PREFIX": "records",
    "FinalNorm": "final_norm",
    "JOB": "records",
    "JOB_FILES": "records",
    "Output": "reader",
    "Plan": "plan",
    "RULES": "final_norm",
    "RunInfo": "records",
    "SAMPLE_INDEX": "manifest",
    "STORED_FIELDS": "manifest",
    "SampleTable": "sample_index",
    "SampleView": "batchfile",
    "StateLayout": "batch",
    "TOPK_IDS": "batch",
    "TOPK_LOGPROBS": "batch",
    "VerifyReport": "verify",
    "batch_key": "keys",
    "batch_metadata": "batch",
    "check_claim": "records",
    "check_file": "verify",
    "checksum": "sample_index",
    "claim_output": "records",
    "decode": "sample_index",
    "delete_manifest": "manifest",
    "dequantize_fp8": "fp8",
    "describe_job": "records",
    "done_in_output": "records",
    "encode": "sample_index",
    "estimate_file_bytes": "batch",
    "forget_job": "records",
    "has_manifest": "manifest",
    "header_expectations": "manifest",
    "job_manifest": "finalize",
    "job_record": "records",
    "load_job_files": "jobfiles",
    "load_plan": "jobfiles",
    "open_output": "reader",
    "plain_memory": "batchfile",
    "publish_job_files": "records",
    "quantize_fp8_": "fp8",
    "read_done": "records",
    "read_final_norm_meta": "final_norm",
    "read_job": "records",
    "read_manifest": "manifest",
    "read_metadata": "writer",
    "read_sample_index": "sample_index",
    "ready_manifest": "finalize",
    "remove_copy": "sample_index",
    "run_file_metadata": "batch",
    "sample_ids_checksum": "records",
    "served_layers": "reader",
    "shard_name": "keys",
    "stored_record": "records",
    "table_from_files": "sample_index",
    "topk_bytes_per_token": "batch",
    "verified_done": "records",
    "verify_output": "verify",
    "write_batch_file": "writer",
    "write_done": "records",
    "write_final_manifest": "finalize",
    "write_final_norm": "final_norm",
}

"""Each public name -> the module of this package that defines it."""

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
