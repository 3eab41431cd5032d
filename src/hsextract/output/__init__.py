"""What an hsextract output is, written and read: open, read and verify one, its plan, and what writes a batch file.
The rest of hsextract (and a trainer) imports from here, never from the modules; the job's ledger (the claim, the
completion records, the manifest's lifecycle) has its own face, ``hsextract.output.ledger`` (ledger.py says who).

Loaded lazily (PEP 562): importing the face loads none of its modules (torch comes with the reader). A name is
public once it is in ``_EXPORTS``; tests/unit/test_layout.py checks that the rest imports from the faces only.
"""

from __future__ import annotations

from hsextract import lazy_exports

_EXPORTS = {
    # open, read and verify an output (a trainer, export, the CLI)
    "open_output": "reader",
    "Output": "reader",
    "served_layers": "reader",
    "read_manifest": "manifest",
    "BatchFile": "batchfile",
    "SampleView": "batchfile",
    "SampleTable": "sample_index",
    "plain_memory": "batchfile",
    "dequantize_fp8": "fp8",
    "verify_output": "verify",
    # the plan: which samples go in which batch file of which shard
    "Plan": "plan",
    "BatchSpec": "plan",
    # what writes a batch file (the run, dry-run, the model's capture)
    "StateLayout": "batch",
    "run_file_metadata": "batch",
    "batch_metadata": "batch",
    "write_batch_file": "writer",
    "read_metadata": "writer",
    "FinalNorm": "final_norm",
    "quantize_fp8_": "fp8",
}

"""Each public name -> the module of this package that defines it."""

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
