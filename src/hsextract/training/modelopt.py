"""ModelOpt's seam: a map-style dataset the HF Trainer takes in place of ``OfflineSupervisedDataset``.

ModelOpt's ``OfflineSupervisedDataset`` reads one ``torch.load`` per path and has no storage seam: its
``__getitem__`` is the whole reader. ``OfflineOutputDataset`` yields the same dict from an output
(schemas.ModelOpt.item is that ``__getitem__``, from the record a ``conv_I.pt`` of ``hsextract export --format
modelopt`` holds), so ModelOpt's ``EagleOfflineDataCollator`` and its HF Trainer (which wraps it in a
``DistributedSampler``) run unchanged:

    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator
    from hsextract.training.modelopt import OfflineOutputDataset
    train = OfflineOutputDataset("s3://bucket/run1", endpoint_url=URL, answer_only_loss=True)
    trainer = Trainer(model, args, train_dataset=train, data_collator=EagleOfflineDataCollator(train_len))
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
