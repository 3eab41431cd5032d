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

from hsextract.training.batching import TokenBudgetBatches
from hsextract.training.collate import packed_collate, pad_collate
from hsextract.training.dataset import StatesDataset, StatesMapDataset
from hsextract.training.index import SampleIndex, index_output
from hsextract.training.schemas import SCHEMAS, Schema, get_schema
from hsextract.training.state import StateError

__all__ = [
    "SCHEMAS",
    "SampleIndex",
    "Schema",
    "StatesDataset",
    "StateError",
    "StatesMapDataset",
    "TokenBudgetBatches",
    "get_schema",
    "packed_collate",
    "pad_collate",
    "index_output",
]
