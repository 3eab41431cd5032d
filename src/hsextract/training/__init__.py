"""Train straight from an output: datasets over its batch files (dataset.py) and each trainer's seam into them.

The seams (``hsextract.training.speculators``, ``.specforge``, ``.modelopt``) live in their own modules, each
importing only its trainer; docs/TRAINING.md shows each in use.
"""

from hsextract import lazy_exports

_EXPORTS = {
    "TokenBudgetBatches": "batching",
    "packed_collate": "collate",
    "pad_collate": "collate",
    "StatesDataset": "dataset",
    "StatesMapDataset": "dataset",
    "SampleIndex": "index",
    "index_output": "index",
    "SCHEMAS": "schemas",
    "Schema": "schemas",
    "get_schema": "schemas",
    "StateError": "state",
}

"""Each public name -> its module, loaded on first use (PEP 562): finalize writes the sample index through
``training.index`` in processes that never import torch."""

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
