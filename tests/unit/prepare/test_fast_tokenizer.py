"""Tests for prepare/fast_tokenizer.py: the Rust backend called directly, only where it gives the call's results."""

from __future__ import annotations

import pytest

from hsextract.demo import build_tokenizer, make_conversations
from hsextract.prepare.fast_tokenizer import direct_backend


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_the_direct_backend_gives_the_calls_ids_and_offsets_on_rendered_conversations(tokenizer):
    backend = direct_backend(tokenizer)
    assert backend is not None
    texts = [
        tokenizer.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=False)
        for r in make_conversations(20, seed=4)
    ]
    texts += ["  leading spaces, ünïcödé, 数字 and\ttabs\n\n", tokenizer.eos_token * 3, ""]
    for text in texts:
        called = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        direct = backend.encode(text, add_special_tokens=False)
        assert direct.ids == called["input_ids"]
        assert direct.offsets == [tuple(o) for o in called["offset_mapping"]]


def test_a_tokenizer_class_that_encodes_its_own_way_keeps_the_full_call(tokenizer):
    class Shouting(type(tokenizer)):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.upper(), *args, **kwargs)

    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(tokenizer.__dict__)
    assert direct_backend(shouting) is None
