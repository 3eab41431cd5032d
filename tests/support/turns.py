"""Token rows shaped as ``--rows per-turn`` makes them under a template that drops earlier reasoning."""

from __future__ import annotations

import torch


def turn_rows(turns: int, seed: int) -> list[list[int]]:
    """Row k is the context up to turn k, then turn k's reasoning and reply; the next context holds the reply
    without its reasoning, then the next user message. So rows are not prefixes of each other."""
    g = torch.Generator().manual_seed(seed)

    def piece(n: int) -> list[int]:
        return torch.randint(1, 500, (n,), generator=g).tolist()

    context, rows = piece(6), []
    for _ in range(turns):
        reply = piece(int(torch.randint(2, 7, (1,), generator=g)))
        rows.append(context + [7] + piece(3) + reply)  # 7: a think token no context holds
        context = context + reply + piece(int(torch.randint(2, 6, (1,), generator=g)))
    return rows


def distinct_tokens(rows) -> int:
    """The nodes of the rows' token trie, counted by brute force: what computing each prefix once costs."""
    return len({tuple(r[: k + 1]) for r in rows for k in range(len(r))})
