"""prepare/snapshot_tokenizer.py: a snapshot tokenizer encodes every row as the transformers tokenizer it was taken
from (the reference: ``RowEncoder`` over that tokenizer), or no snapshot is taken; tokenizing from one imports no
transformers."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys

import pytest

from hsextract.demo import build_tokenizer
from hsextract.prepare.chat import RowEncoder
from hsextract.prepare.snapshot_tokenizer import SnapshotTokenizer
from hsextract.prepare.tokenize import tokenizer_fingerprint
from hsextract.prepare.tokenizer_record import take_snapshot
from unit.prepare.test_data import (
    AGENT_MESSAGES,
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    QWEN3_TEMPLATE_WITH_GENERATION_TAGS,
    varied_conversations,
    with_template,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def templated(tokenizer, name: str):
    if name == "demo":
        return tokenizer
    if name == "qwen3":
        other = copy.deepcopy(tokenizer)
        other.chat_template = QWEN3_TEMPLATE_WITH_GENERATION_TAGS  # {% generation %} tags included
        return other
    specials = {
        "llama3": (
            ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "<|begin_of_text|>",
        ),
        "mistral": (["<s>", "</s>", "[INST]", "[/INST]"], "<s>"),
    }[name]
    return with_template(tokenizer, {"llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}[name], *specials)


def rows():
    odd = ["  leading spaces, ünïcödé, 数字\t\n", "<|im_end|> inside text <|im_start|>", ""]
    extra = [
        {"id": "agent", "messages": AGENT_MESSAGES},
        *({"id": f"text-{i}", "text": t} for i, t in enumerate(odd)),
        {"id": "bad", "messages": [{"role": "assistant", "content": 3}]},
        {"id": "ids", "input_ids": [1, 2, 3]},
    ]
    return varied_conversations(60, seed=3) + extra


@pytest.mark.parametrize(
    "template, too_long",
    [
        ("demo", "truncate"),
        ("demo", "skip"),
        ("qwen3", "truncate"),
        ("llama3", "skip"),
        ("mistral", "truncate"),
    ],
)
def test_rows_encode_the_same_from_the_snapshot_as_from_the_tokenizer(tokenizer, template, too_long):
    tok = templated(tokenizer, template)
    snapshot = take_snapshot(tok)
    assert snapshot is not None
    snap = pickle.loads(pickle.dumps(SnapshotTokenizer(snapshot)))  # as a pool's processes get it
    assert tokenizer_fingerprint(snap) == tokenizer_fingerprint(tok)
    reference, ours = RowEncoder(tok, 96, too_long), RowEncoder(snap, 96, too_long)
    statuses = set()
    for i, row in enumerate(rows()):
        a, b = reference.encode(i, row), ours.encode(i, row)
        assert a[:4] == b[:4], row.get("id")
        assert (a[4] is None and b[4] is None) or (a[4].tolist(), a[5].tolist()) == (
            b[4].tolist(),
            b[5].tolist(),
        )
        statuses.add(a[2])
    assert {"kept", "malformed", "empty", "truncated" if too_long == "truncate" else "too_long"} <= statuses


def test_a_tokenizer_the_snapshot_cannot_stand_for_gets_none(tokenizer):
    several = copy.deepcopy(tokenizer)
    several.chat_template = {"default": tokenizer.chat_template, "tool_use": tokenizer.chat_template}
    assert take_snapshot(several) is None
    truncating = copy.deepcopy(tokenizer)
    truncating.backend_tokenizer.enable_truncation(8)
    assert take_snapshot(truncating) is None
    assert take_snapshot(object()) is None


CHAT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_tokenizing_from_a_snapshot_imports_no_transformers(tokenizer, tmp_path):
    path = tmp_path / "snap.pkl"
    path.write_bytes(pickle.dumps((SnapshotTokenizer(take_snapshot(tokenizer)), None)))  # as a pool sends it
    code = (
        "import sys\n"
        "from hsextract.prepare.tokenize import _encode_chunk, _init_worker\n"
        f"_init_worker(open({str(path)!r}, 'rb').read(), 64, 'truncate')\n"
        f"rows, ids, mask = _encode_chunk([(0, 0, {CHAT_ROW!r})])\n"
        "print(rows[0][3], ids.tolist(), 'transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    expected = RowEncoder(tokenizer, 64, "truncate").encode(0, CHAT_ROW)[4].tolist()
    assert out.split(maxsplit=1)[0] == "kept"
    assert out.strip().endswith("False False") and str(expected) in out


EDGE_TEMPLATES = {
    "fields": "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.missing is defined }}|{{ m.get('name', '-') }}"
    "{% endfor %}",
    "dict-methods": "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}"
    "{{ m.keys() | list | length }}{% endfor %}",
    "a-key-named-like-a-method": "{% for m in messages %}{{ m.items }}{{ m['items'] }}{% endfor %}",
    "string-methods": "{% for m in messages %}{{ m.content.split(' ')[0].upper() }}"
    "{{ m.content.startswith('Hi') }}{% endfor %}",
    "mutating-a-list": "{% set x = messages.append(1) %}{{ messages | length }}",
    "mutating-a-dict": "{{ messages[0].update({'role': 'x'}) }}",
    "class-attribute": "{{ messages.__class__ }}",
    "mro-of-a-type": "{{ ''.__class__.mro() }}",
    "format-string": "{{ '{0.__class__}'.format(messages) }}",
}


@pytest.mark.parametrize("name", list(EDGE_TEMPLATES))
def test_the_snapshots_sandbox_renders_and_refuses_as_transformers_does(tokenizer, name):
    """Each attribute a template reads, the unsafe ones included, answers as in transformers' own sandbox."""
    other = copy.deepcopy(tokenizer)
    other.chat_template = EDGE_TEMPLATES[name]
    messages = [{"role": "user", "content": "Hi there", "items": "x"}, {"role": "assistant", "content": "Yo"}]
    snap = SnapshotTokenizer(
        {
            "backend": other.backend_tokenizer.to_str(),
            "chat_template": other.chat_template,
            "special_tokens_map": other.special_tokens_map,
        }
    )
    results = []
    for tok in (other, snap):
        try:
            results.append(tok.apply_chat_template(copy.deepcopy(messages), tokenize=False))
        except Exception as e:
            results.append(f"{type(e).__name__}: {e}")
    assert results[0] == results[1]
    if name in ("mutating-a-list", "mutating-a-dict", "mro-of-a-type"):
        assert results[1].startswith("SecurityError"), results[1]
