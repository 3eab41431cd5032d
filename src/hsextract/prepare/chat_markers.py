"""Template text found by rendering probe conversations: what opens and closes an assistant turn, for any chat
template (nothing about one is hard-coded)."""

from __future__ import annotations

from dataclasses import dataclass

_PROBE_USER = "hsextract probe question"


_PROBE_REPLY = "hsextract probe answer"


def _common_prefix(texts: list[str]) -> str:
    first = min(texts, key=len)
    for n, ch in enumerate(first):
        if any(t[n] != ch for t in texts):
            return first[:n]
    return first


@dataclass(frozen=True)
class ChatMarkers:
    """Template text found by rendering probe conversations, used to cut and locate assistant turns."""

    generation_header: str
    """What ``add_generation_prompt`` appends, e.g. ``<|im_start|>assistant\\n``; empty for Mistral-style templates."""
    end_of_turn: str
    """First chunk the template writes after an assistant message, e.g. ``<|im_end|>``; may be empty."""
    role_header: str = ""
    """What opens every assistant turn wherever it sits (and the generation prompt), e.g.
    ``<|im_start|>assistant\\n``; empty when the probes share none."""

    @classmethod
    def probe(cls, tokenizer, render, plain=None) -> ChatMarkers:
        """``render(messages, generation_prompt)`` renders as the encoder does (template and arguments); ``plain``
        without the arguments: the role header is what both write (``preserve_thinking`` opens every turn with
        ``<think>``, which is the turn's own text, not its header)."""
        user = [{"role": "user", "content": _PROBE_USER}]
        try:
            bare = render(user, False)
            prompted = render(user, True)
            header = prompted[len(bare) :] if prompted.startswith(bare) else ""
        except Exception:
            header = ""
        try:
            text = render([*user, {"role": "assistant", "content": _PROBE_REPLY}], False)
        except Exception:
            return cls(header, "")
        after = text[text.rfind(_PROBE_REPLY) + len(_PROBE_REPLY) :].lstrip()
        chunk = after.split()[0] if after.split() else ""
        # "<|im_end|><|endoftext|>" -> "<|im_end|>": a chunk that opens with a special token ends with it.
        end = chunk
        for token in sorted(tokenizer.get_added_vocab(), key=len, reverse=True):
            if token and chunk.startswith(token):
                end = token
                break
        heads = _assistant_heads(render, header, end) if header else []
        if heads and plain is not None:
            heads += _assistant_heads(plain, "", end) or [""]
        return cls(header, end, _common_prefix(heads) if heads else "")


def _assistant_heads(render, generation_header: str, end_of_turn: str) -> list[str]:
    """The generation prompt (if given) and the text before an assistant reply early (before a later user query)
    and last in a conversation; empty if a probe fails."""
    if not end_of_turn:
        return []
    early, late = _PROBE_REPLY + " one", _PROBE_REPLY + " two"
    conversation = [
        {"role": "user", "content": _PROBE_USER},
        {"role": "assistant", "content": early},
        {"role": "user", "content": _PROBE_USER + " again"},
        {"role": "assistant", "content": late},
    ]
    try:
        text = render(conversation, False)
        before_first = render(conversation[:1], False)
        before_last = render(conversation[:3], False)
    except Exception:
        return []
    heads = [generation_header] if generation_header else []
    for before, reply in ((before_first, early), (before_last, late)):
        at = text.find(reply)
        if not text.startswith(before) or at < len(before):
            return []
        heads.append(text[len(before) : at])
    return heads
