"""The data report: what became of every row, in all and per source, written next to the outputs.

Bad rows never crash a run and are never dropped silently: each is counted as malformed, empty, too long or (with
``--dedupe``) a duplicate, with a few examples. ``ReportBuilder`` counts as the tokenizer's results arrive, so no
row is held for it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from hsextract.errors import HsextractError
from hsextract.prepare.template_error import is_template_failure
from hsextract.validation import parse

TOO_LONG_POLICIES = ("truncate", "skip")

"""What becomes of a row over ``max_length`` tokens: cut to it (counted ``truncated``) or left out
(``skipped_too_long``)."""


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
    unrendered: dict[str, int] = field(default_factory=dict)
    """Kept rows carrying what the chat template left out of the tokens: ``reasoning`` (of a reply after the last
    user message: the model wrote it), ``earlier reasoning`` (of turns before a later user message, as Qwen's
    templates and the server drop it) and ``tools`` (a template without a tools section)."""
    token_ids: dict[str, int] = field(default_factory=dict)
    """Kept chat rows by where their ids came from: ``server`` (the ids ``hsextract regenerate`` stored) or
    ``text`` (rendered here); ``prompt_differs``: server rows whose prompt ids differ from hsextract's rendering
    of the same messages (a template, option or tokenizer that is not the server's; examples of kind
    ``prompt_differs``)."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, where: str = "the data report") -> DataReport:
        """Every field strictly typed, and counts a preparation makes (none negative, no more kept than read)."""
        report = parse(cls, data, lambda problems: HsextractError(f"{where} is damaged ({problems})"))
        if problem := report.problem():
            raise HsextractError(f"{where} is damaged ({problem})")
        return report

    def problem(self) -> str | None:
        """What no preparation writes, though every field has its type: a negative count, more rows kept than
        read, more truncated than kept."""
        for name in (*COUNTS, "tokens"):
            if getattr(self, name) < 0:
                return f"{name}: {getattr(self, name)} is negative"
        if self.kept > self.rows or self.truncated > self.kept:
            return f"kept {self.kept} of {self.rows} rows, {self.truncated} truncated: not counts of one data"
        return None

    def summary(self) -> str:
        """One line for the console, e.g. ``300 rows: 297 kept (3 truncated to 2048 tokens), 2 empty, ...``."""
        return (
            f"{_summary(self.to_json(), self.max_length)}; {self.tokens} tokens{_unrendered(self.unrendered)}"
            f"{_token_ids(self.token_ids)}"
        )

    def rendering_lines(self, of: str = "") -> tuple[list[str], list[str]]:
        """(warnings, notes) on how the kept rows were rendered (``of``: e.g. ``"sampled "``). Warnings: the
        reasoning of a last reply left out (the model wrote it, the tokens leave it out), and server prompt ids that
        differ from hsextract's rendering (with the first difference). What the template drops otherwise the server
        drops too, so the states are the server's: a note with a count."""
        warnings, notes = [], []
        for what, n in sorted(self.unrendered.items()):
            rows = f"{n} of {self.kept} {of}rows"
            if what == "reasoning":
                warnings.append(
                    f"{rows} carry reasoning in a reply after the last user message that the chat template does "
                    "not render: the model wrote it, the tokens leave it out (give the server's template and "
                    "arguments: --chat-template, --chat-template-kwargs)"
                )
            elif n:
                notes.append(
                    f"{rows} carry {what} that the chat template drops, as the server does (counted)"
                )
        if differs := self.token_ids.get("prompt_differs"):
            first = next(
                (e for e in self.examples if e["kind"] == "prompt_differs"), {"id": "?", "reason": ""}
            )
            warnings.append(
                f"{differs} of {self.kept} {of}rows: the server's prompt ids differ from hsextract's rendering "
                f"of the same messages (first, {first['id']}: {first['reason']}); give --chat-template and "
                "--chat-template-kwargs as the server had them"
            )
        return warnings, notes

    def source_lines(self) -> list[str]:
        """One line per source (for a mix), e.g. ``tools (hf:org/tools): 50 rows: 49 kept, 1 malformed``."""
        return [
            f"{s['name']} ({s['source']}): {_summary(s, self.max_length)}{_unrendered(s.get('unrendered') or {})}"
            for s in self.sources
        ]

    def regenerated_lines(self) -> list[str]:
        """Per source written by ``hsextract regenerate``: the served model and the options its replies came from,
        e.g. ``regen: replies of Qwen/Qwen3.6-27B (max_tokens 4096, temperature 0.6, turns all)``."""
        lines = []
        for s in self.sources:
            regenerated = (s.get("identity") or {}).get("regenerated")
            if not regenerated:
                continue
            settings = regenerated.get("settings") or {}
            options = {**(settings.get("request") or {}), "turns": settings.get("turns")}
            if settings.get("drop_truncated"):
                options["drop_truncated"] = True
            shown = ", ".join(
                f"{k} {json.dumps(v) if isinstance(v, dict) else v}" for k, v in options.items()
            )
            ids = s.get("token_ids") or {}
            origin = f"; token ids: {ids.get('server', 0)} rows the server's, {ids.get('text', 0)} rendered from text"
            lines.append(f"{s['name']}: replies of {settings.get('served_model')} ({shown}){origin}")
        return lines

    def first_problems(self) -> list[str]:
        """The first skipped row of each kind, with its reason, for the console (the report keeps 5 of each)."""
        lines, seen = [], set()
        for e in self.examples:
            if e["kind"] in ("malformed", "empty", "too_long", "prompt_differs") and e["kind"] not in seen:
                seen.add(e["kind"])
                where = f"row {e['row']}" + (f" of {e['source']}" if "source" in e else "")
                lines.append(
                    f"first {e['kind'].replace('_', ' ')} row: {where} (id {e['id']}): {e['reason']}"
                )
        return lines

    def mostly_dropped(self) -> str | None:
        """A warning when most rows were malformed or empty: skipped one by one, they would pass unremarked."""
        bad = self.skipped_malformed + self.skipped_empty
        if bad * 2 <= self.rows:
            return None
        return (
            f"warning: most of the data was dropped: {bad} of {self.rows} rows are malformed or empty "
            "(first problems above); fix the data or its columns (docs/DATA.md), or pass --max-bad-rows to stop "
            "on such data instead of skipping it"
        )

    def check_bad_rows(self, limit: int | float | None) -> None:
        """``--max-bad-rows``: more malformed or empty rows than a count, or than a fraction of the rows read, stop
        the preparation."""
        bad = self.skipped_malformed + self.skipped_empty
        allowed = limit if limit is None or isinstance(limit, int) else limit * self.rows
        if allowed is None or bad <= allowed:
            return
        share = f"{limit:g} of the rows read, {allowed:.1f}" if isinstance(limit, float) else f"{limit}"
        first = [e for e in self.examples if e["kind"] in ("malformed", "empty")]
        raise HsextractError(
            f"{bad} of {self.rows} rows are malformed or empty, more than --max-bad-rows allows ({share}). "
            f"First problems: {grouped_problems(first)}. Fix those rows, or raise --max-bad-rows to skip them"
        )


def _unrendered(counts: dict) -> str:
    """``; reasoning not rendered in 3 rows`` (what the template left out), or nothing."""
    return "".join(f"; {what} not rendered in {n} rows" for what, n in sorted(counts.items()) if n)


def _token_ids(counts: dict) -> str:
    """``; 3 rows with the server's token ids; 1 whose server prompt ids differ from hsextract's``, or nothing."""
    out = f"; {counts['server']} rows with the server's token ids" if counts.get("server") else ""
    if counts.get("prompt_differs"):
        out += (
            f"; {counts['prompt_differs']} rows whose server prompt ids differ from hsextract's rendering (give "
            "--chat-template and --chat-template-kwargs as the server had them)"
        )
    return out


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
        self.sources = [
            {**d, **dict.fromkeys(COUNTS, 0), "tokens": 0, "unrendered": {}, "token_ids": {}}
            for d in described_sources
        ]
        self.examples: list[dict] = []
        self._per_kind: dict[str, int] = {}

    def add(
        self,
        source: int,
        position: int,
        sample_id: str,
        status: str,
        reason: str,
        tokens: int,
        unrendered: tuple[str, ...] = (),
        ids_from: str = "",
        prompt_differs: str = "",
    ) -> None:
        """``ids_from`` and ``prompt_differs``: see ``RowEncoder.encode_rows``."""
        counts = self.sources[source]
        counts["rows"] += 1
        if status in _STATUS_COUNT:
            counts[_STATUS_COUNT[status]] += 1
            self._example(counts, position, sample_id, status, reason)
        if status in ("kept", "truncated"):
            counts["kept"] += 1
            counts["tokens"] += tokens
            for what in unrendered:
                counts["unrendered"][what] = counts["unrendered"].get(what, 0) + 1
            for what in (ids_from, "prompt_differs" if prompt_differs else ""):
                if what:
                    counts["token_ids"][what] = counts["token_ids"].get(what, 0) + 1
            if prompt_differs:
                self._example(counts, position, sample_id, "prompt_differs", prompt_differs)

    def _example(self, counts: dict, position: int, sample_id: str, kind: str, reason: str) -> None:
        n = self._per_kind[kind] = self._per_kind.get(kind, 0) + 1
        if n <= EXAMPLES_PER_KIND:
            where = {"source": counts["name"]} if self.labelled else {}
            self.examples.append({**where, "row": position, "id": sample_id, "kind": kind, "reason": reason})

    def report(self) -> DataReport:
        total = {key: sum(s[key] for s in self.sources) for key in (*COUNTS, "tokens")}
        unrendered: dict[str, int] = {}
        token_ids: dict[str, int] = {}
        for s in self.sources:
            for into, key in ((unrendered, "unrendered"), (token_ids, "token_ids")):
                for what, n in s[key].items():
                    into[what] = into.get(what, 0) + n
        return DataReport(
            **total,
            max_length=self.max_length,
            examples=self.examples,
            sources=self.sources,
            unrendered=unrendered,
            token_ids=token_ids,
        )

    def check_usable(self, labels: list[str], *, cut: bool = False) -> None:
        """A source none of whose rows is usable is an error naming it: extracting nothing is never meant. With
        ``cut`` (``--max-samples``) a source of which no row was read is not: the limit was reached before it."""
        for label, counts in zip(labels, self.sources, strict=True):
            if counts["kept"] or counts["skipped_duplicate"] or (cut and not counts["rows"]):
                continue
            examples = [e for e in self.examples if e.get("source", counts["name"]) == counts["name"]]
            problems = grouped_problems(examples)
            raise HsextractError(
                f"no usable samples in {label}: {_summary(counts, self.max_length)}."
                + (f" First problems: {problems}." if problems else "")
                + f" {advice(counts, examples, self.max_length)}"
            )


def grouped_problems(examples: list[dict]) -> str:
    """``rows 0, 1, 2 (malformed): the same reason`` once per distinct reason, in the order first seen."""
    by_reason: dict[tuple[str, str], list[str]] = {}
    for e in examples:
        by_reason.setdefault((e["kind"], e["reason"]), []).append(str(e["row"]))
    return "; ".join(
        f"{'rows' if len(rows) > 1 else 'row'} {', '.join(rows)} ({kind}): {reason}"
        for (kind, reason), rows in by_reason.items()
    )


def advice(counts: dict, examples: list[dict], max_length: int) -> str:
    """What to do about a source without a usable row, from what its rows' problems were."""
    reasons = " ".join(e["reason"] for e in examples)
    if counts["skipped_too_long"] and not (counts["skipped_malformed"] or counts["skipped_empty"]):
        return (
            f"Every row is longer than --max-length {max_length} with --too-long skip: raise --max-length (and "
            f"--max-tokens-per-batch with it), or give --too-long truncate to keep each row's first {max_length} "
            "tokens."
        )
    if any(is_template_failure(e["reason"]) for e in examples):
        return (
            "The chat template fails on these rows (the reasons above name it, its line and the error): fix the "
            "template, or give the server's own with --chat-template."
        )
    if "tokenizer" in reasons or "chat template" in reasons:
        return (
            "The rows need what the tokenizer lacks (--tokenizer's when given, else --model's): give its directory "
            "the tokenizer's files and chat template (the checkpoint's own), or pre-tokenized rows made with it."
        )
    if "none of the fields" in reasons:
        return (
            "Map the source's columns onto the row fields with its columns= option, e.g. "
            "'data.jsonl?columns=messages:dialog' (docs/DATA.md), or drop the source."
        )
    return "Fix the rows or drop the source (docs/DATA.md lists the row kinds)."


def bad_rows_limit(value) -> int | float | None:
    """``--max-bad-rows`` as a count (int) or a fraction in [0, 1) (float)."""
    number = value
    if isinstance(value, str):
        for kind in (int, float):
            try:
                number = kind(value.strip())
                break
            except ValueError:
                continue
    if value is None or (type(number) is int and number >= 0) or (type(number) is float and 0 <= number < 1):
        return number
    raise HsextractError(
        f"--max-bad-rows {value!r}: give a count of rows (100) or a fraction of the rows read (0.01)"
    )
