"""Collate functions for the datasets' items, whose lengths differ (torch's default collate refuses them).

A field is per token when its first dimension is the sample's length: ``pad_collate`` pads those to the longest
sample, ``packed_collate`` concatenates them into one row with ``cu_seqlens`` (no padding at all).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100

"""What padded ``labels`` hold: the index cross-entropy ignores."""


def _per_token(items: list[dict]) -> list[str]:
    lengths = [len(item["input_ids"]) for item in items]
    first = items[0]
    return [
        key
        for key, value in first.items()
        if isinstance(value, torch.Tensor)
        and value.dim() >= 1
        and all(
            isinstance(item[key], torch.Tensor) and item[key].dim() >= 1 and item[key].shape[0] == n
            for item, n in zip(items, lengths, strict=True)
        )
    ]


def _others(items: list[dict], skip: list[str]) -> dict:
    out = {}
    for key in items[0]:
        if key in skip:
            continue
        values = [item[key] for item in items]
        same_shape = all(isinstance(v, torch.Tensor) and v.shape == values[0].shape for v in values)
        out[key] = torch.stack(values) if same_shape else values
    return out


def pad_collate(items: list[dict], *, pad_id: int = 0) -> dict:
    """Per-token fields padded at the end to the longest sample and stacked ([B, T, ...]); ``attention_mask`` [B, T]
    (1 for real tokens); ``labels`` padded with ``IGNORE_INDEX``, every other field with ``pad_id`` or 0."""
    per_token = _per_token(items)
    longest = max(len(item["input_ids"]) for item in items)
    batch = {}
    for key in per_token:
        fill = IGNORE_INDEX if key == "labels" else (pad_id if key == "input_ids" else 0)
        first = items[0][key]
        out = torch.full((len(items), longest, *first.shape[1:]), fill, dtype=first.dtype)
        for row, item in enumerate(items):
            out[row, : item[key].shape[0]] = item[key]
        batch[key] = out
    if "attention_mask" not in batch:
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        for row, item in enumerate(items):
            mask[row, : len(item["input_ids"])] = 1
        batch["attention_mask"] = mask
    batch.update(_others(items, per_token))
    return batch


def packed_collate(items: list[dict]) -> dict:
    """Per-token fields concatenated into one row ([total tokens, ...]), with ``cu_seqlens`` (int32 [B + 1], the
    samples' start offsets and the total), ``max_seqlen`` and ``position_ids`` restarting at 0 for each sample."""
    per_token = _per_token(items)
    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    batch = {key: torch.cat([item[key] for item in items]) for key in per_token}
    batch["cu_seqlens"] = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    batch["max_seqlen"] = int(lengths.max())
    if "position_ids" not in batch:
        batch["position_ids"] = torch.cat([torch.arange(int(n)) for n in lengths])
    batch.update(_others(items, per_token))
    return batch
