"""A fast tokenizer's Rust backend, called without transformers' call around it (which costs a share of every row's
encoding, docs/PERFORMANCE.md).

Called directly, the backend gives the same ids and offsets when the tokenizer's class encodes the standard way and
nothing is left on the backend that the call would turn off; both are checked once, on a probe, before use.
"""

from __future__ import annotations

PROBE = "hsextract probe: ünïcödé 数字 123\n\t  x "


def direct_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` to encode with directly, or None when only the full call is known right."""
    from hsextract.prepare.snapshot_tokenizer import SnapshotTokenizer

    if isinstance(tokenizer, SnapshotTokenizer):
        return tokenizer.backend_tokenizer  # snapshots are taken only of tokenizers that pass the check below
    from transformers import PreTrainedTokenizerFast as Fast

    if not isinstance(tokenizer, Fast):
        return None
    if type(tokenizer).__call__ is not Fast.__call__ or type(tokenizer)._encode_plus is not Fast._encode_plus:
        return None  # a class that encodes its own way
    probe = PROBE + " ".join(getattr(tokenizer, "all_special_tokens", []))
    # The call leaves its backend without truncation or padding, as each such call does; then both must agree.
    wrapped = tokenizer(probe, add_special_tokens=False, return_offsets_mapping=True)
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:
        return None
    direct = backend.encode(probe, add_special_tokens=False)
    offsets = [tuple(o) for o in wrapped["offset_mapping"]]
    return backend if direct.ids == list(wrapped["input_ids"]) and direct.offsets == offsets else None


class OwnBackend:
    """``(text, offsets) -> (ids, character offsets or None)`` through the tokenizer: its Rust backend directly when
    ``direct_backend`` allows, else its call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.direct = direct_backend(tokenizer)

    def __call__(self, text: str, offsets: bool) -> tuple[list, list | None]:
        if self.direct is not None:
            encoding = self.direct.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.offsets if offsets else None
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)
        return encoding["input_ids"], encoding["offset_mapping"] if offsets else None
