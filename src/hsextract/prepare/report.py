"""The data report: what became of every row, in all and per source, written next to the outputs.

Bad rows never crash a run and are never dropped silently: each is counted as malformed, empty, too long or (with
``--dedupe``) a duplicate, with a few examples. ``ReportBuilder`` counts as the tokenizer's results arrive, so no
row is held for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hsextract.errors import HsextractError
from hsextract.validation import parse

EXAMPLES_PER_KIND = 5

"""Examples kept in the report for each of malformed, empty, too long, truncated and duplicate."""


COUNTS = (
    "rows",
    "kept",
    "truncated",
    "skipped_empty",
    "skipped_malformed",
    "skipped_too_long",
    "skipped_duplicate",
)


@dataclass(frozen=True)
class DataReport:
    """What became of each row of the data; the caller writes ``to_json()`` into the run directory."""

    rows: int
    kept: int
    truncated: int
    """Kept rows cut to ``max_length`` tokens (counted in ``kept`` too)."""
    skipped_empty: int
    skipped_malformed: int
    skipped_too_long: int
    tokens: int
    """Kept tokens, after truncation."""
    max_length: int
    examples: list[dict] = field(default_factory=list)
    """A few ``{"source", "row", "id", "kind", "reason"}`` for skipped and truncated rows, at most 5 of each kind."""
    skipped_duplicate: int = 0
    """Rows whose token ids equal an earlier row's (``--dedupe`` only)."""
    sources: list[dict] = field(default_factory=list)
    """Per source, in order: name, location, kind, options, identity, and the counts above."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, where: str = "the data report") -> DataReport:
        return parse(cls, data, lambda problems: HsextractError(f"{where} is damaged ({problems})"))

    def summary(self) -> str:
        """One line for the console, e.g. ``300 rows: 297 kept (3 truncated to 2048 tokens), 2 empty, ...``."""
        return f"{_summary(self.to_json(), self.max_length)}; {self.tokens} tokens"

    def source_lines(self) -> list[str]:
        """One line per source (for a mix), e.g. ``tools (hf:org/tools): 50 rows: 49 kept, 1 malformed``."""
        return [f"{s['name']} ({s['source']}): {_summary(s, self.max_length)}" for s in self.sources]


def _summary(counts: dict, max_length: int) -> str:
    kept = f"{counts['kept']} kept"
    if counts["truncated"]:
        kept += f" ({counts['truncated']} truncated to {max_length} tokens)"
    parts = [kept]
    for key, words in (
        ("skipped_empty", "empty"),
        ("skipped_malformed", "malformed"),
        ("skipped_too_long", f"longer than {max_length} tokens skipped"),
        ("skipped_duplicate", "duplicates dropped"),
    ):
        if counts.get(key):
            parts.append(f"{counts[key]} {words}")
    return f"{counts['rows']} rows: {', '.join(parts)}"


_STATUS_COUNT = {
    "truncated": "truncated",
    "empty": "skipped_empty",
    "malformed": "skipped_malformed",
    "too_long": "skipped_too_long",
    "duplicate": "skipped_duplicate",
}


class ReportBuilder:
    """Counts the encoder's results per source as they arrive."""

    def __init__(self, described_sources: list[dict], max_length: int, *, labelled: bool):
        self.max_length = max_length
        self.labelled = labelled
        self.sources = [{**d, **dict.fromkeys(COUNTS, 0), "tokens": 0} for d in described_sources]
        self.examples: list[dict] = []
        self._per_kind: dict[str, int] = {}

    def add(self, source: int, position: int, sample_id: str, status: str, reason: str, tokens: int) -> None:
        counts = self.sources[source]
        counts["rows"] += 1
        if status in _STATUS_COUNT:
            counts[_STATUS_COUNT[status]] += 1
            n = self._per_kind[status] = self._per_kind.get(status, 0) + 1
            if n <= EXAMPLES_PER_KIND:
                where = {"source": counts["name"]} if self.labelled else {}
                self.examples.append(
                    {**where, "row": position, "id": sample_id, "kind": status, "reason": reason}
                )
        if status in ("kept", "truncated"):
            counts["kept"] += 1
            counts["tokens"] += tokens

    def report(self) -> DataReport:
        total = {key: sum(s[key] for s in self.sources) for key in (*COUNTS, "tokens")}
        return DataReport(**total, max_length=self.max_length, examples=self.examples, sources=self.sources)

    def check_usable(self, labels: list[str]) -> None:
        """A source none of whose rows is usable is an error naming it: extracting nothing is never meant."""
        for label, counts in zip(labels, self.sources, strict=True):
            if counts["kept"] or counts["skipped_duplicate"]:
                continue
            problems = "; ".join(
                f"row {e['row']} ({e['kind']}): {e['reason']}"
                for e in self.examples
                if e.get("source", counts["name"]) == counts["name"]
            )
            raise HsextractError(
                f"no usable samples in {label}: {_summary(counts, self.max_length)}."
                + (f" First problems: {problems}." if problems else "")
                + " Fix the rows (or the source's columns= option) or drop the source."
            )
