"""What an hsextract output is, written and read: open, read and verify one, its plan, and what writes a batch file.
The rest of hsextract (and a trainer) imports from here, never from the modules; the job's ledger (the claim, the
completion records, the manifest's lifecycle) has its own face, ``hsextract.output.ledger`` (ledger.py says who).

Loaded lazily (PEP 562): importing the face loads none of its modules (torch comes with the reader). A name is
public once it is in ``_EXPORTS``; tests/unit/test_layout.py checks that the rest imports from the faces only.
"""

from __future__ import annotations

from hsextract import lazy_exports

_EXPORTS = {
    "BatchFile": "batchfile",
    "BatchSpec": "plan",
    "FinalNorm": "final_norm",
    "Output": "reader",
    "Plan": "plan",
    "SampleTable": "sample_index",
    "SampleView": "batchfile",
    "StateLayout": "batch",
    "batch_metadata": "batch",
    "dequantize_fp8": "fp8",
    "open_output": "reader",
    "plain_memory": "batchfile",
    "quantize_fp8_": "fp8",
    "read_manifest": "manifest",
    "read_metadata": "writer",
    "run_file_metadata": "batch",
    "served_layers": "reader",
    "verify_output": "verify",
    "write_batch_file": "writer",
}

"""Each public name -> the module of this package that defines it."""

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
