"""The plan: which samples go in which batch, and which shard runs it. Pure and deterministic (no torch).

Samples are sorted by length, longest first, and cut greedily into batches bounded by
``rows x longest row <= max_tokens_per_batch`` and ``rows <= max_rows``. Rows are padded, never packed: packing
is wrong for hybrid models whose linear-attention recurrence and causal conv carry state across sample
boundaries. Sorting keeps padding waste small (0.3% on realistic lengths) and puts the largest batch first, so a
batch that does not fit in memory fails in the first minute rather than the last hour.

Batches are dealt to shards largest first, each to the shard with the fewest padded tokens so far (LPT), so shards
finish together. Batch ids are global and stable; a batch's output key is ``shard-SSSSS/batch-BBBBBB.safetensors``.
The plan hash covers the fingerprint (data, tokenizer, model, layers, limits) and every batch, so a rerun can prove
it is continuing the same job.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from typing_extensions import NotRequired, TypedDict  # pydantic reads TypedDicts from here before Python 3.12

from hsextract.errors import HsextractError
from hsextract.output import batch_key
from hsextract.storage.fileio import atomic_write, read_bytes
from hsextract.validation import parse

PLAN_FORMAT = 1


@dataclass(frozen=True, slots=True)
class BatchSpec:
    batch_id: int
    shard: int
    sample_indices: tuple[int, ...]
    """Indices into the tokenized samples, longest first."""
    padded_length: int
    """Length of the longest row; every row is right-padded to it."""
    num_tokens: int
    """Valid (unpadded) tokens in the batch."""

    @property
    def rows(self) -> int:
        return len(self.sample_indices)

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.padded_length

    @property
    def key(self) -> str:
        return batch_key(self.shard, self.batch_id)


@dataclass(frozen=True, slots=True)
class Plan:
    batches: tuple[BatchSpec, ...]
    shards: int
    fingerprint: dict
    """Everything that shapes the output: data and tokenizer hashes, model, layer ids, dtype, limits."""

    _hash: list = field(default_factory=list, init=False, repr=False, compare=False)
    """The plan hash once computed (a one-item list: the plan is frozen); it serializes every batch."""

    @property
    def plan_hash(self) -> str:
        """The fingerprint, shard count and every batch, hashed: computed once per plan."""
        if not self._hash:
            body = json.dumps(
                {
                    "format": PLAN_FORMAT,
                    "fingerprint": self.fingerprint,
                    "shards": self.shards,
                    "batches": [_batch_fields(b) for b in self.batches],
                },
                sort_keys=True,
            )
            self._hash.append(hashlib.sha256(body.encode()).hexdigest()[:16])
        return self._hash[0]

    def for_shard(self, shard: int) -> list[BatchSpec]:
        return [b for b in self.batches if b.shard == shard]

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.batches)

    @property
    def num_samples(self) -> int:
        return sum(b.rows for b in self.batches)

    @property
    def padding_waste(self) -> float:
        padded = sum(b.padded_tokens for b in self.batches)
        return 0.0 if padded == 0 else 1.0 - self.num_tokens / padded

    def shard_tokens(self) -> list[int]:
        totals = [0] * self.shards
        for b in self.batches:
            totals[b.shard] += b.num_tokens
        return totals

    def summary(self) -> str:
        per = self.shard_tokens()
        idle = [s for s, tokens in enumerate(per) if tokens == 0]
        batches = f"{len(self.batches)} batch" + ("" if len(self.batches) == 1 else "es")
        spread = f"tokens per shard {min(per)}..{max(per)}" if len(per) > 1 else f"{per[0]} tokens"
        return (
            f"{self.num_samples} samples, {self.num_tokens} tokens in {batches} over {self.shards} shard(s) "
            f"({spread}), padding waste {100 * self.padding_waste:.2f}%"
            + (
                f"; shard(s) {idle} get no batch (fewer batches than shards: fewer --shards would do)"
                if idle
                else ""
            )
        )

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "plan_hash": self.plan_hash,
            "shards": self.shards,
            "fingerprint": self.fingerprint,
            "batches": [
                [b.batch_id, b.shard, b.padded_length, b.num_tokens, list(b.sample_indices)]
                for b in self.batches
            ],
        }

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls.from_json(read_bytes(path, "the plan"), where=str(path))

    @classmethod
    def from_json(cls, body: dict | bytes | str, where: str = "the plan") -> Plan:
        """The plan of ``to_json``'s value (or its JSON text), every field checked, and its recorded ``plan_hash``
        against the hash of what it holds (the plan proves itself: an edit, even of two samples swapped, is
        seen); a clear error naming ``where`` if damaged."""

        def damaged(problems: str) -> HsextractError:
            return HsextractError(
                f"{where} (the plan) is damaged ({problems}): nothing was changed; rerun the same command with "
                "--restart to start over"
            )

        fields = parse(PlanJson, body, damaged)
        batches = tuple(
            BatchSpec(batch_id=i, shard=s, sample_indices=tuple(idx), padded_length=p, num_tokens=n)
            for i, s, p, n, idx in fields["batches"]
        )
        plan = cls(batches=batches, shards=fields["shards"], fingerprint=fields["fingerprint"])
        if problem := plan._problem():
            raise damaged(problem)
        recorded = fields.get("plan_hash")
        if recorded is not None and recorded != plan.plan_hash:
            raise damaged(f"its content hashes to {plan.plan_hash}, not its recorded plan_hash {recorded}")
        return plan

    def _problem(self) -> str | None:
        """What no plan ``make_plan`` writes holds: a shard outside the count, a batch id out of order, a count
        that is not positive, more tokens than its padded rows hold."""
        if self.shards < 1:
            return f"shards {self.shards} is not positive"
        for i, b in enumerate(self.batches):
            if (
                b.batch_id != i
                or not 0 <= b.shard < self.shards
                or b.padded_length < 1
                or not b.sample_indices
            ):
                return f"batch {i} (id {b.batch_id}, shard {b.shard}) does not fit the plan"
            if not b.rows <= b.num_tokens <= b.padded_tokens:
                return f"batch {i} holds {b.num_tokens} tokens in {b.rows} rows of {b.padded_length}"
        if self.batches:
            every = np.sort(np.concatenate([np.asarray(b.sample_indices) for b in self.batches]))
            if not np.array_equal(every, np.arange(len(every))):
                return "its batches do not hold each sample index 0..N-1 exactly once"
        return None


class PlanJson(TypedDict):
    """What ``Plan.to_json`` writes and ``from_json`` reads (the hash is computed again and must match)."""

    format: Literal[1]
    shards: int
    fingerprint: dict
    batches: list[tuple[int, int, int, int, list[int]]]
    """Per batch: id, shard, padded length, tokens, sample indices."""
    plan_hash: NotRequired[str]
    """Checked against the hash of the rest: the plan proves itself."""


def _batch_fields(b: BatchSpec) -> dict:
    """``dataclasses.asdict`` of a batch without its deep copy (the same JSON, several times faster)."""
    return {
        "batch_id": b.batch_id,
        "shard": b.shard,
        "sample_indices": b.sample_indices,
        "padded_length": b.padded_length,
        "num_tokens": b.num_tokens,
    }


def make_plan(
    lengths: Sequence[int],
    *,
    max_tokens_per_batch: int,
    max_rows: int,
    shards: int,
    fingerprint: dict | None = None,
) -> Plan:
    """Cut samples (given by their token counts) into padded, length-sorted batches dealt to ``shards``."""
    counts = np.asarray(lengths, dtype=np.int64)
    if len(counts) and counts.min() < 1:
        raise ValueError("every sample needs at least one token")
    if len(counts) and counts.max() > max_tokens_per_batch:
        raise ValueError(
            f"a sample of {counts.max()} tokens exceeds max_tokens_per_batch={max_tokens_per_batch}"
        )
    # Longest first, ties by index: a stable sort of the negated lengths (numpy's, at a million samples).
    order = np.argsort(-counts, kind="stable")
    sorted_counts = counts[order]
    # A batch takes samples while rows x its first (longest) row fits and rows <= max_rows: from its first sample
    # on, exactly min(max_rows, budget // longest) of them, or what is left. One step per batch, not per sample.
    starts: list[int] = []
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
        longest = int(sorted_counts[start])
        assigned.append(
            BatchSpec(
                batch_id=batch_id,
                shard=shard,
                sample_indices=tuple(indices[start:end]),
                padded_length=longest,
                num_tokens=tokens_per_batch[batch_id],
            )
        )
        heapq.heappush(load, (tokens + (end - start) * longest, shard))
    return Plan(batches=tuple(assigned), shards=shards, fingerprint=dict(fingerprint or {}))


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
