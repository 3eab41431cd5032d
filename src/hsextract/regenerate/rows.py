"""Which rows of the mix are requested: every row once, with the id ``run`` gives it, minus those done.

The mix is read twice: once to count (rows without prompts, duplicates with ``--dedupe``, rows already in
complete chunks) so that the progress bar knows its total and nothing is held in memory but ids, and once more,
as the requests go out, to hand over the conversations still to do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from hsextract.prepare.sources import Mix
from hsextract.regenerate.turns import Conversation, RowSkipped, conversation

SKIP_WORDS = {
    "malformed": "malformed",
    "not_chat": "text or token rows (no prompts)",
    "no_prompt": "without a user message to answer",
    "duplicate": "duplicates (--dedupe)",
}


@dataclass
class Selection:
    """The rows of the mix by what becomes of them in this run."""

    rows: int = 0
    skipped: Counter = field(default_factory=Counter)
    """By kind: malformed, not_chat, no_prompt, duplicate."""
    examples: list[str] = field(default_factory=list)
    done: int = 0
    """In complete chunks of an earlier run (written or dropped)."""
    todo: set[str] = field(default_factory=set)

    def summary(self) -> str:
        parts = [f"{len(self.todo)} to request"]
        if self.done:
            parts.append(f"{self.done} already in the output")
        parts += [f"{n} {SKIP_WORDS[kind]}" for kind, n in sorted(self.skipped.items())]
        return f"{self.rows} rows: {', '.join(parts)}"


class _UniqueIds:
    """Repeated ids renamed as ``run`` renames them (``id#2``, ``id#3``...), so that each row is one sample."""

    def __init__(self):
        self.seen: dict[str, int] = {}

    def __call__(self, sample_id: str) -> str:
        n = self.seen.get(sample_id, 0) + 1
        self.seen[sample_id] = n
        if n == 1:
            return sample_id
        renamed = f"{sample_id}#{n}"
        while renamed in self.seen:
            renamed += "'"
        self.seen[renamed] = 1
        return renamed


def conversations(mix: Mix, turns: str, dedupe: bool) -> Iterator[Conversation | RowSkipped]:
    """Every row of the mix in order, as a conversation or the reason it has none."""
    unique, prompts = _UniqueIds(), set()
    for source, position, row in mix.rows():
        row_id = row.get("id") if isinstance(row, dict) else None
        sample_id = mix.sample_id(source, str(position if row_id is None else row_id))
        try:
            conv = conversation(sample_id, source, row, turns)
        except RowSkipped as e:
            yield RowSkipped(e.kind, e.reason, sample_id)
            continue
        if dedupe:
            key = conv.prompt_key()
            if key in prompts:
                yield RowSkipped("duplicate", "its prompts equal an earlier row's", sample_id)
                continue
            prompts.add(key)
        yield Conversation(unique(sample_id), source, conv.prompts, conv.tools, conv.cut_at_tool)


def select(mix: Mix, turns: str, dedupe: bool, done) -> Selection:
    """The first pass: counts, and the ids still to request."""
    selection = Selection()
    for item in conversations(mix, turns, dedupe):
        selection.rows += 1
        if isinstance(item, RowSkipped):
            selection.skipped[item.kind] += 1
            if len(selection.examples) < 5:
                selection.examples.append(f"{item.sample_id} ({item.kind}): {item.reason}")
        elif item.sample_id in done:
            selection.done += 1
        else:
            selection.todo.add(item.sample_id)
    return selection


def to_request(mix: Mix, turns: str, dedupe: bool, todo: set[str]) -> Iterator[Conversation]:
    """The second pass: the conversations of ``todo``, in the mix's order."""
    for item in conversations(mix, turns, dedupe):
        if isinstance(item, Conversation) and item.sample_id in todo:
            yield item
