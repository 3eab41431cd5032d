"""Rows that share a token prefix (``--rows per-turn``: row k is the conversation up to turn k), captured with each
shared prefix computed once through transformers' cache (full-attention keys and values, Gated-DeltaNet convolution
and recurrent states), one row at a time on the stock forward; each row's states are stored in full. Rows run in
token order, so rows that branch off one point follow each other; a copy of the cache is kept at each branch point.
The fused kernels (qwen3_5.py) keep no cache. ``scripts/bench_prefix.py`` measures it (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hsextract.model.capture import GatherTarget, LayerCapture


@dataclass(frozen=True)
class Segment:
    """One forward of the schedule: tokens ``start:end`` of row ``row``, from the checkpoint at depth ``start``
    (0: an empty cache); ``keep``: the cache and states at ``end`` are kept as a checkpoint for later rows."""

    row: int
    start: int
    end: int
    keep: bool


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_schedule(rows: Sequence[Sequence[int]]) -> list[list[Segment]]:
    """The forwards that capture ``rows`` with each shared prefix computed once, grouped by the row they finish,
    in the order they run. Each row ends with a forward of at least its last token, where its states are joined
    (a row that is a whole prefix of another runs its last token again)."""
    order = sorted(range(len(rows)), key=lambda i: list(rows[i]))
    # The branch depth of each row with the next in order; a checkpoint there serves the next row.
    branch = [common_prefix(rows[a], rows[b]) for a, b in zip(order, order[1:], strict=False)] + [0]
    depths = [0]  # the depths of the checkpoints held, a stack along the current row's path
    schedule = []
    for k, i in enumerate(order):
        n = len(rows[i])
        resume = min(common_prefix(rows[order[k - 1]], rows[i]) if k else 0, n - 1)
        while depths[-1] > resume:
            depths.pop()
        segments, at = [], depths[-1]
        if at < resume:  # the row before, a prefix of this one, kept no checkpoint at its own end
            segments.append(Segment(i, at, resume, keep=True))
            depths.append(resume)
            at = resume
        for keep_at in _branch_points(branch, k, at, n - 1):
            segments.append(Segment(i, at, keep_at, keep=True))
            depths.append(keep_at)
            at = keep_at
        segments.append(Segment(i, at, n, keep=False))
        schedule.append(segments)
    return schedule


def _branch_points(branch: list[int], k: int, after: int, before: int) -> list[int]:
    """The depths in ``after < d <= before`` where a later row branches off row ``k``'s path, ascending: the row
    after ``j`` shares ``min(branch[k..j])`` tokens with row ``k``, so the branch points are the running minima."""
    points, low = [], before
    for d in branch[k:]:
        low = min(low, d)
        if low <= after:
            break
        if not points or low < points[-1]:
            points.append(low)
    return points[::-1]


def computed_tokens(rows: Sequence[Sequence[int]]) -> int:
    """The tokens ``capture_into`` runs through the model for ``rows``."""
    return sum(s.end - s.start for segments in prefix_schedule(rows) for s in segments)


def capture_into(cap: LayerCapture, rows: Sequence[torch.Tensor], target: GatherTarget) -> None:
    """Fill ``target`` (its ``flat_index`` unused) with the rows' tokens one after another, as a batch file lays
    them out, computed along ``prefix_schedule``. ``rows`` are 1-D id tensors on the model's device; call inside
    ``inference_mode``."""
    from transformers import DynamicCache

    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + len(r))
    fields = [f for f in ("out", "scale", "topk_ids", "topk_logprobs") if getattr(target, f) is not None]
    # (depth, cache at that depth, each field's segments of the tokens before it)
    stack = [(0, DynamicCache(config=cap.lm.config.get_text_config()), {f: [] for f in fields})]
    for segments in prefix_schedule([r.tolist() for r in rows]):
        for seg in segments:
            while stack[-1][0] > seg.start:
                stack.pop()
            depth, held, before = stack[-1]
            assert depth == seg.start, (depth, seg)
            # The forward updates a cache in place: a copy, so the checkpoint stays as it was.
            cache = copy.deepcopy(held)
            ids = rows[seg.row][seg.start : seg.end]
            n = len(ids)
            part = GatherTarget(
                flat_index=torch.arange(n, device=ids.device),
                **{f: getattr(target, f).new_empty((n, *getattr(target, f).shape[1:])) for f in fields},
            )
            positions = torch.arange(seg.start, seg.end, device=ids.device)[None]
            cap.forward(ids[None], None, part, cache=cache, position_ids=positions)
            states = {f: [*before[f], getattr(part, f)] for f in fields}
            if seg.keep:
                stack.append((seg.end, cache, states))
            else:
                for f in fields:  # copies, not a cat: fp8 has none
                    at = offsets[seg.row]
                    for piece in states[f]:
                        getattr(target, f)[at : at + len(piece)].copy_(piece)
                        at += len(piece)
