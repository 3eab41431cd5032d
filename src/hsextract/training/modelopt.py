"""ModelOpt's seam: ``OfflineOutputDataset``, a map-style dataset the HF Trainer takes in place of
``OfflineSupervisedDataset``.

ModelOpt's dataset has no storage seam (one ``torch.load`` per path), so this one yields the same dict from an
output (schemas.ModelOpt.item) and ModelOpt's collator and Trainer run unchanged. docs/TRAINING.md shows it in use.
"""

from __future__ import annotations

import torch

from hsextract.training.dataset import StatesMapDataset
from hsextract.training.schemas import ModelOpt


class OfflineOutputDataset(StatesMapDataset):
    """``OfflineSupervisedDataset[i]`` for sample ``i`` of an output (manifest order)."""

    def __init__(
        self,
        output,
        *,
        answer_only_loss: bool = False,
        endpoint_url: str | None = None,
        verify: bool = True,
        dtype=torch.bfloat16,
    ):
        # answer_only_loss=False is ModelOpt's own default: a mask of ones.
        super().__init__(
            output, ModelOpt(answer_only_loss), endpoint_url=endpoint_url, verify=verify, dtype=dtype
        )
