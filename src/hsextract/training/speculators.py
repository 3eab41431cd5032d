"""speculators' seam: a ``hs_connectors.HiddenStatesTransfer`` that reads an output's states in place.

speculators' ``ArrowDataset`` takes the samples' table from ``hsextract export --format speculators --index-only``
and each sample's states from ``OutputTransfer``, which returns the record ``hs_I.safetensors`` of a full export
would hold; its sampler and collator run unchanged. docs/TRAINING.md shows it in use.
"""

from __future__ import annotations

from typing import Any

import torch
from hs_connectors.transfer import HiddenStatesTransfer

from hsextract.training.dataset import StatesMapDataset


class OutputTransfer(HiddenStatesTransfer):
    """Sample ``file_idx`` of an output as speculators' hs file: ``hidden_states`` [T, k+1, H], ``token_ids`` [T].

    Opened lazily in each process (``setup`` or the first read), so it pickles into DataLoader workers."""

    def __init__(
        self,
        output,
        *,
        endpoint_url: str | None = None,
        verify: bool = True,
        dtype=torch.bfloat16,
        layers=None,
    ):
        """``layers``: the stored layers to serve, in this order (ids or a preset), as ``StatesMapDataset`` takes
        them: an output of several presets serves one drafter's."""
        self.data = StatesMapDataset(
            output, "speculators", endpoint_url=endpoint_url, verify=verify, dtype=dtype, layers=layers
        )

    def setup(self) -> None:
        self.data.reader()

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        if not 0 <= file_idx < len(self.data):
            return None  # speculators then applies its on_missing policy
        return self.data.record(file_idx)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise NotImplementedError(
            "an hsextract output holds extracted states only; it generates none (use on_missing='raise')"
        )
