"""A padded batch as the capture takes it, built from sequences of token ids."""

import torch


def padded(seqs, device="cpu"):
    """Right-padded ``ids`` and ``mask`` of ``seqs``, and the flat positions of their tokens (a capture's rows)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    flat = torch.cat([torch.arange(r * width, r * width + len(s)) for r, s in enumerate(seqs)])
    return ids.to(device), mask.to(device), flat.to(device)
