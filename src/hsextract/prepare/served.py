"""What a conversation's tokens are when a server wrote its replies: the server's own ids where ``regenerate``
stored them (a reply is not always its text's canonical tokenization), one row per assistant turn, and cut replies
that end where the model stopped. hsextract still renders each served prompt and reports where it differs (a
template, option or tokenizer that is not the server's). docs/DATA.md says which tokens the target sees.
"""

from __future__ import annotations

from dataclasses import dataclass

ROWS = ("conversation", "per-turn")

"""``conversation``: one row per conversation, every assistant turn in the loss; ``per-turn``: one row per assistant
turn, the conversation up to it as the server rendered it then, the loss on that turn alone."""

PROMPT_IDS, COMPLETION_IDS = "prompt_token_ids", "token_ids"

"""The fields of a stored reply that hold the server's ids (vLLM's names)."""

TURN_SUFFIX = "#t"

"""Turn k (1-based) of sample ``id`` is sample ``id#tk`` with ``--rows per-turn``."""


@dataclass(frozen=True)
class ServedIds:
    """One reply's ids as the server gave them."""

    prompt: list[int]
    completion: list[int]


def take_served_ids(messages: list[dict]) -> dict[int, ServedIds]:
    """The server's ids of each assistant message that carries both lists of integers, by message index; the
    id fields are taken off every message (templates never see them)."""
    served = {}
    for i, message in enumerate(messages):
        prompt, completion = message.pop(PROMPT_IDS, None), message.pop(COMPLETION_IDS, None)
        if message["role"] == "assistant" and _ints(prompt) and _ints(completion) is not None:
            served[i] = ServedIds(list(prompt), list(completion))
    return served


def _ints(value) -> list | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def is_cut(message: dict) -> bool:
    """A reply the server stopped at ``max_tokens``."""
    return message.get("role") == "assistant" and message.get("finish_reason") == "length"


def said_end(full: str, start: int, end: int, message: dict) -> int:
    """Where the text a cut reply said ends in ``full[start:end]`` (its turn): after its content, else after its
    reasoning; ``start`` when neither is found (nothing of it is masked)."""
    for key in ("content", "reasoning_content"):
        for text in (
            message.get(key) or "",
            (message.get(key) or "").strip(),
        ):  # as said, else as a template trims
            at = full.rfind(text, start, end) if text.strip() else -1
            if at >= 0:
                return at + len(text)
    return start


def trim_cut_turns(
    full: str, spans: list[tuple[int, int]], messages: list[dict]
) -> tuple[list[tuple[int, int]], int | None]:
    """The assistant spans with each cut reply's span ending where its text ends, and where ``full`` is to end when
    the conversation's last message is a cut reply (None: as it is). ``spans`` must be one per assistant message."""
    replies = [m for m in messages if m["role"] == "assistant"]
    if len(spans) != len(replies):
        return spans, None
    trimmed = [
        (start, said_end(full, start, end, m) if is_cut(m) else end)
        for (start, end), m in zip(spans, replies, strict=True)
    ]
    end = trimmed[-1][1] if trimmed and messages[-1]["role"] == "assistant" and is_cut(messages[-1]) else None
    return trimmed, end


def turn_rows(row: dict, messages: list[dict], sample_id: str) -> list[dict]:
    """``row`` as one row per assistant turn: turn k's messages end with its reply, its id is ``sample_id#tk``."""
    said = ("content", "tool_calls", "reasoning_content")
    out = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and any(message.get(k) for k in said):
            sub = {k: v for k, v in row.items() if k not in ("messages", "conversations", "system")}
            sub["messages"] = messages[: i + 1]
            sub["id"] = f"{sample_id}{TURN_SUFFIX}{len(out) + 1}"
            out.append(sub)
    return out


def turn_groups(sample_ids: list[str]) -> list[int]:
    """A group number per sample: the turn rows of one conversation (ids ``<id>#t<k>``, adjacent) share one."""
    groups, last = [], None
    for sample_id in sample_ids:
        head, sep, turn = sample_id.rpartition(TURN_SUFFIX)
        key = head if sep and turn.isdigit() else sample_id
        groups.append(groups[-1] if groups and key == last else len(groups))
        last = key
    return groups


def first_difference(tokenizer, server: list[int], own: list[int]) -> str:
    """ "" when the lists are equal, else where they first differ, decoded: ``token 12 of 40: the server has
    '<|im_start|>' ... where hsextract renders ...``."""
    if list(server) == list(own):
        return ""
    n = next(
        (k for k, (a, b) in enumerate(zip(server, own, strict=False)) if a != b), min(len(server), len(own))
    )

    def shown(ids: list[int]) -> str:
        text = tokenizer.decode(list(ids[n : n + 8])) if n < len(ids) else ""
        return repr(text) if text else "nothing (its end)"

    return (
        f"token {n} of {len(server)} (hsextract renders {len(own)}): the server has {shown(server)}, hsextract "
        f"renders {shown(own)}"
    )


def served_row(
    encoder, messages: list[dict], tools: list | None, served: dict[int, ServedIds], last_only: bool
):
    """``(ids, mask, differs)`` of a conversation whose last reply carries the server's ids: that reply's prompt
    ids and completion ids, the completion in the loss; without ``last_only`` the earlier turns are in the loss
    too, where hsextract's rendering of the prompt gives the server's ids (else the mask cannot place them).
    ``differs`` names the first turn whose server prompt ids differ from hsextract's rendering ("" if none)."""
    import numpy as np

    from hsextract.prepare.messages import _malformed

    last = max(served)
    differs, prompt_mask = "", None
    for turn, i in enumerate(sorted(served), 1):
        if last_only and i != last:
            continue
        own, mask = encoder.prompt_tokens(messages[:i], tools, with_mask=i == last and not last_only)
        difference = first_difference(encoder.tokenizer, served[i].prompt, own)
        if difference and not differs:
            differs = difference if last_only else f"turn {turn}: {difference}"
        if i == last and not difference:
            prompt_mask = mask
    reply = served[last]
    ids = np.asarray(reply.prompt + reply.completion, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= encoder.vocab_size):
        raise _malformed(
            f"the server's token ids fall outside the tokenizer's range 0..{encoder.vocab_size - 1}: the server "
            "ran another tokenizer than --model's"
        )
    if prompt_mask is None:
        prompt_mask = np.zeros(len(reply.prompt), dtype=np.uint8)
    mask = np.concatenate([prompt_mask, np.ones(len(reply.completion), dtype=np.uint8)])
    return ids.astype(np.int32), mask, differs
