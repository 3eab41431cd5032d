"""What computing each shared prefix once saves for ``--rows per-turn`` (model/prefix.py), and whether its states
are those of each whole row.

Conversations of ``--turns`` turns (a user message, a reply with reasoning) are rendered one row per assistant turn
by the public Qwen3 template, which drops earlier turns' reasoning: row k is the context up to turn k plus turn k's
reply, so rows are not prefixes of each other. Modes, on the same rows and layers:

- ``whole``: each row through the hooked model on its own;
- ``padded``: all rows in one right-padded batch, longest first (what a run computes today, as one batch);
- ``shared``: ``prefix.capture_into``, each shared prefix once through transformers' cache, one row at a time.

Printed per model (the tiny random qwen3_5 of the tests, a ``--hidden``-wide one of the same kind, a Llama):
stored tokens (the rows' lengths), distinct tokens (the rows' token trie: the least any prefix sharing computes),
computed tokens of each mode, the largest absolute and relative difference of shared's states from whole's, and
wall times (best of ``--repeat``).

    python scripts/bench_prefix.py --turns 3 10 --conversations 4
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import benchlib  # noqa: E402, F401  (puts src/ on the path)

from hsextract.demo import _sentence, build_tokenizer, tiny_qwen3_5_config  # noqa: E402
from hsextract.model.capture import GatherTarget, LayerCapture  # noqa: E402
from hsextract.model.prefix import capture_into, common_prefix, computed_tokens  # noqa: E402

TEMPLATE = benchlib.ROOT / "tests" / "data" / "chat_templates" / "qwen3.jinja"


def conversation(turns: int, rng: random.Random) -> list[dict]:
    """A system prompt and ``turns`` (user, reply with reasoning) pairs of chat-like lengths."""
    messages = [{"role": "system", "content": _sentence(rng, rng.randint(5, 30))}]
    for _ in range(turns):
        messages.append({"role": "user", "content": _sentence(rng, int(rng.lognormvariate(3.0, 0.7)))})
        messages.append(
            {
                "role": "assistant",
                "reasoning_content": _sentence(rng, int(rng.lognormvariate(3.5, 0.6))),
                "content": _sentence(rng, int(rng.lognormvariate(3.5, 0.7))),
            }
        )
    return messages


def turn_rows(tokenizer, messages: list[dict]) -> list[list[int]]:
    """One row per assistant turn: ``apply_chat_template`` of the messages up to and with that reply."""
    return [
        list(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=True)["input_ids"])
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
    ]


def distinct_tokens(rows: list[list[int]]) -> int:
    """The nodes of the rows' token trie."""
    ordered = sorted(rows)
    return sum(len(r) - (common_prefix(ordered[k - 1], r) if k else 0) for k, r in enumerate(ordered))


def whole(cap: LayerCapture, rows: list[torch.Tensor], hidden: int) -> list[torch.Tensor]:
    out = []
    for ids in rows:
        target = GatherTarget(torch.arange(len(ids)), torch.empty(len(ids), len(cap.layer_ids), hidden))
        cap.forward(ids[None], None, target)
        out.append(target.out)
    return out


def padded(cap: LayerCapture, rows: list[torch.Tensor], hidden: int) -> None:
    order = sorted(rows, key=len, reverse=True)
    width = len(order[0])
    ids = torch.zeros(len(order), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(order):
        ids[r, : len(row)], mask[r, : len(row)] = row, 1
    flat = mask.view(-1).nonzero().squeeze(1)
    cap.forward(ids, mask, GatherTarget(flat, torch.empty(len(flat), len(cap.layer_ids), hidden)))


def shared(cap: LayerCapture, rows: list[torch.Tensor], hidden: int) -> list[torch.Tensor]:
    target = GatherTarget(None, torch.empty(sum(map(len, rows)), len(cap.layer_ids), hidden))
    capture_into(cap, rows, target)
    return list(target.out.split([len(r) for r in rows]))


def timed(repeat: int, fn):
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def compare(lm, layer_ids, groups: list[list[list[int]]], repeat: int) -> tuple:
    """Wall times of ``whole``, ``padded`` and ``shared`` over the groups, and shared's largest absolute and relative (per
    row, L2) difference from whole."""
    hidden = lm.config.hidden_size
    tensors = [[torch.tensor(r) for r in g] for g in groups]
    with LayerCapture(lm, layer_ids) as cap, torch.inference_mode():
        t_whole, ref = timed(repeat, lambda: [whole(cap, g, hidden) for g in tensors])
        t_shared, got = timed(repeat, lambda: [shared(cap, g, hidden) for g in tensors])
        t_padded, _ = timed(repeat, lambda: padded(cap, [r for g in tensors for r in g], hidden))
    pairs = [(a, b) for ga, gb in zip(got, ref, strict=True) for a, b in zip(ga, gb, strict=True)]
    abs_diff = max((a - b).abs().max().item() for a, b in pairs)
    rel_diff = max(((a - b).norm() / b.norm()).item() for a, b in pairs)
    return t_whole, t_padded, t_shared, abs_diff, rel_diff


def models(vocab: int, hidden: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM

    torch.manual_seed(0)
    tiny = tiny_qwen3_5_config(vocab)
    wide = tiny_qwen3_5_config(vocab)
    wide.hidden_size, wide.intermediate_size, wide.head_dim = hidden, 3 * hidden, hidden // 4
    wide.linear_key_head_dim = wide.linear_value_head_dim = hidden // 4
    llama = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    )
    return {
        "qwen3_5 tiny (h64, 8 layers)": Qwen3_5ForCausalLM(tiny),
        f"qwen3_5 (h{hidden}, 8 layers)": Qwen3_5ForCausalLM(wide),
        f"llama (h{hidden}, 8 layers)": LlamaForCausalLM(llama),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[3, 10])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", default="1,3,6", help="captured layer ids (output of layer k)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layer_ids = tuple(int(x) for x in args.layers.split(","))
    tokenizer = build_tokenizer(tempfile.mkdtemp(prefix="bench-prefix-"))
    tokenizer.chat_template = TEMPLATE.read_text()
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
        f"float32, layers {layer_ids}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| model | turns | rows | stored | distinct | computed padded | computed shared | shared/distinct "
        "| max abs diff | max rel diff | whole s | padded s | shared s | padded/shared |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, lm in models(len(tokenizer), args.hidden).items():
        lm.eval()
        for turns in args.turns:
            rng = random.Random(turns)
            groups = [turn_rows(tokenizer, conversation(turns, rng)) for _ in range(args.conversations)]
            stored = sum(len(r) for g in groups for r in g)
            distinct = sum(distinct_tokens(g) for g in groups)
            computed = sum(computed_tokens(g) for g in groups)
            padded_tokens = sum(map(len, groups)) * max(len(r) for g in groups for r in g)
            t_whole, t_padded, t_shared, abs_diff, rel_diff = compare(lm, layer_ids, groups, args.repeat)
            print(
                f"| {name} | {turns} | {sum(map(len, groups))} | {stored} | {distinct} | {padded_tokens} | {computed} "
                f"| {computed / distinct:.3f} | {abs_diff:.1e} | {rel_diff:.1e} | {t_whole:.2f} | {t_padded:.2f} "
                f"| {t_shared:.2f} | {t_padded / t_shared:.2f} |"
            )


if __name__ == "__main__":
    main()
