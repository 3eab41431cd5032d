"""The plan's record: which samples go in which batch, and which shard runs it; its hash, its file, its checks.

``make_plan`` (prepare/plan.py) makes one; the launcher writes it into the run dir and publishes it in the output,
whose job files it heads. The plan hash covers the fingerprint (data, tokenizer, model, layers, limits) and every
batch, so a rerun can prove it is continuing the same job, and a plan read back proves itself by its hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from typing_extensions import NotRequired, TypedDict  # pydantic reads TypedDicts from here before Python 3.12

from hsextract.errors import HsextractError
from hsextract.output.keys import batch_key
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
