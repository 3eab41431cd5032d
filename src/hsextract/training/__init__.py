"""Train straight from an output: datasets over its batch files (dataset.py) and each trainer's seam into them.

``StatesDataset`` (iterable, distributed, shuffled, resumable) and ``StatesMapDataset`` (index -> item) yield a
schema's items (schemas.py): ``raw`` (the reader's dict), ``specforge-dflash``, ``specforge-eagle3``,
``speculators``, ``modelopt``: what that trainer's own dataset yields. ``StatesDataset(..., follow=True)`` trains
while the output is still written (follow.py); ``cache_dir=`` keeps what is read on local disk for later epochs
(storage/cache.py); ``TokenBudgetBatches`` batches the map-style dataset by token budget, grouped by length
(batching.py); ``pad_collate`` and ``packed_collate`` (collate.py) batch items of different lengths, padded or
packed with ``cu_seqlens``. A resume state or an argument that does not fit is refused naming it (``StateError``,
state.py). The trainer seams live in their own modules (``hsextract.training.speculators``, ``.specforge``,
``.modelopt``), each importing only its trainer.
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
