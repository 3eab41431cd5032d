"""The plan: which samples go in which batch, and which shard runs it. Pure and deterministic (no torch).

Samples sorted longest first are cut greedily into batches under the token and row caps: rows are padded, never
packed (docs/ARCHITECTURE.md says why), sorting keeps padding small, and the largest batch comes first so that one
too large for memory fails at once. Batches go to the shard with the fewest padded tokens so far (largest first),
so shards finish together. The plan's record is the output's (output/plan.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from hsextract.output import BatchSpec, Plan


def make_plan(
    lengths: Sequence[int],
    *,
    max_tokens_per_batch: int,
    max_rows: int,
    shards: int,
    fingerprint: dict | None = None,
    groups: Sequence[int] | None = None,
) -> Plan:
    """Cut samples (given by their token counts) into padded, length-sorted batches dealt to ``shards``.

    With ``groups`` (a group number per sample, the rows of a group adjacent: ``--rows per-turn``'s turns of one
    conversation) the samples stay in their order and a batch ends only between groups, unless one group alone
    exceeds the caps: its rows are then computed with their shared prefixes once (model/prefix.py), unpadded, so
    the token cap bounds the stored tokens, not rows x longest."""
    counts = np.asarray(lengths, dtype=np.int64)
    if len(counts) and counts.min() < 1:
        raise ValueError("every sample needs at least one token")
    if len(counts) and counts.max() > max_tokens_per_batch:
        raise ValueError(
            f"a sample of {counts.max()} tokens exceeds max_tokens_per_batch={max_tokens_per_batch}"
        )
    if groups is not None:
        order = np.arange(len(counts))
        sorted_counts = counts
        starts = _group_starts(counts, groups, max_tokens_per_batch, max_rows)
    else:
        # Longest first, ties by index: a stable sort of the negated lengths (numpy's, at a million samples).
        order = np.argsort(-counts, kind="stable")
        sorted_counts = counts[order]
        # A batch takes samples while rows x its first (longest) row fits and rows <= max_rows: from its first
        # sample on, exactly min(max_rows, budget // longest) of them, or what is left. One step per batch.
        starts = []
        at = 0
        while at < len(order):
            starts.append(at)
            at += min(max_rows, max_tokens_per_batch // int(sorted_counts[at]))
    tokens_per_batch = np.add.reduceat(sorted_counts, starts).tolist() if starts else []
    indices = order.tolist()

    # LPT: biggest batch to the least loaded shard; ties go to the lower shard id.
    load = [(0, s) for s in range(shards)]
    heapq.heapify(load)
    assigned = []
    for batch_id, (start, end) in enumerate(zip(starts, starts[1:] + [len(indices)], strict=True)):
        tokens, shard = heapq.heappop(load)
        longest = int(sorted_counts[start:end].max())
        assigned.append(
            BatchSpec(
                batch_id=batch_id,
                shard=shard,
                sample_indices=tuple(indices[start:end]),
                padded_length=longest,
                num_tokens=tokens_per_batch[batch_id],
            )
        )
        cost = tokens_per_batch[batch_id] if groups is not None else (end - start) * longest
        heapq.heappush(load, (tokens + cost, shard))
    return Plan(batches=tuple(assigned), shards=shards, fingerprint=dict(fingerprint or {}))


def _group_starts(counts: np.ndarray, groups: Sequence[int], max_tokens: int, max_rows: int) -> list[int]:
    """Where the batches of samples in their order begin: a batch takes whole groups while its tokens and rows
    fit, and a group that fits no batch alone is cut where the caps fall."""
    if len(groups) != len(counts):
        raise ValueError(f"{len(groups)} group numbers for {len(counts)} samples")
    starts: list[int] = []
    tokens = rows = 0
    group_start = 0
    for i, n in enumerate(counts.tolist()):
        if i and groups[i] != groups[i - 1]:
            group_start = i
        if not starts or tokens + n > max_tokens or rows + 1 > max_rows:
            # Back to the group's start when the batch holds something before it and the group fits a batch.
            whole = counts[group_start : i + 1].sum() <= max_tokens and i + 1 - group_start <= max_rows
            at = group_start if starts and group_start > starts[-1] and whole else i
            starts.append(at)
            tokens, rows = int(counts[at:i].sum()), i - at
        tokens += n
        rows += 1
    return starts


def fingerprint_changes(old: dict, new: dict, _prefix: str = "") -> list[str]:
    """Human lines naming what differs between two plan fingerprints; nested parts (a data source's options)
    by their path, e.g. ``sources.tools.limit: 50 -> 40``."""
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += fingerprint_changes(a, b, f"{_prefix}{key}.")
        elif a != b:
            lines.append(f"{_prefix}{key}: {a!r} -> {b!r}")
    return lines
