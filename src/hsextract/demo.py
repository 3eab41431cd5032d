"""The embedded default: a tiny random ``qwen3_5`` model, a tiny tokenizer and sample conversations.

Nothing here is downloaded, so tests and the README's first command run anywhere; yet the parts are real: a
byte-level BPE with a ChatML-style template that handles tools and ``<think>`` as Qwen's do, and transformers'
own ``Qwen3_5ForCausalLM`` (Gated-DeltaNet mixed with full attention, as in the target) with random weights.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
from pathlib import Path

from hsextract.config import RunConfig

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}"
    "<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>{{ '\\n' }}"
    "{%- elif messages[0].role == 'system' -%}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}"
    "{%- if not loop.first -%}<|im_start|>system\n{{ m.content }}<|im_end|>{{ '\\n' }}{%- endif -%}"
    "{%- elif m.role == 'user' -%}"
    "<|im_start|>user\n{{ m.content }}<|im_end|>{{ '\\n' }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content or '' -%}"
    "{%- if loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "<|im_start|>assistant\n{{ content }}"
    "{%- for tc in m.tool_calls or [] -%}"
    '{% if content or not loop.first %}\n{% endif %}<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    "{{ tc.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor -%}"
    "<|im_end|>{{ '\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)


SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]


_WORDS = (
    "the model reads each token and writes a hidden state for every layer we ask for while the drafter "
    "learns to guess the next tokens from those states def return import class for while if else print "
    "tensor batch shard layer output bucket upload resume plan padding length sorted kernel memory "
    "function value list dict string number error result python code test data train speed fast slow"
).split()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n_words)))


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` chat rows with varied lengths: system prompts, multi-turn, tool calls and ``<think>`` blocks."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages: list[dict] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": _sentence(rng, rng.randint(3, 12))})
        use_tools = rng.random() < 0.2
        turns = rng.choice([1, 1, 1, 2, 2, 3])
        for _ in range(turns):
            messages.append({"role": "user", "content": _sentence(rng, int(rng.lognormvariate(2.5, 0.9)))})
            answer = _sentence(rng, int(rng.lognormvariate(3.2, 1.0)))
            if rng.random() < 0.3:
                answer = f"<think>\n{_sentence(rng, rng.randint(4, 30))}\n</think>\n\n{answer}"
            if use_tools and rng.random() < 0.6:
                call = {"function": {"name": "get_weather", "arguments": {"city": rng.choice(_WORDS)}}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                messages.append({"role": "tool", "content": _sentence(rng, rng.randint(2, 10))})
            messages.append({"role": "assistant", "content": answer})
        row: dict = {"id": f"conv-{i:05d}", "messages": messages}
        if use_tools:
            row["tools"] = TOOLS
        rows.append(row)
    return rows


def build_tokenizer(out_dir: str | Path, corpus: list[dict] | None = None, vocab_size: int = 600):
    """Train a byte-level BPE on the demo conversations and save it with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = corpus if corpus is not None else make_conversations(300, seed=1)
    texts = [m.get("content") or "" for row in corpus for m in row["messages"]]
    texts += ['{"name": "get_weather", "arguments": {"city": "x"}}', json.dumps(TOOLS)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def tiny_qwen3_5_config(vocab_size: int, num_hidden_layers: int = 8, pad_token_id: int = 0):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        pad_token_id=pad_token_id,
        eos_token_id=pad_token_id,
        tie_word_embeddings=False,
        # Large enough that consecutive layers differ by 30-50%: a capture shifted by one layer cannot hide
        # inside the tolerance of a comparison (with the default 0.02 they differ by 0.3%).
        initializer_range=0.1,
    )


def build_model(out_dir: str | Path, num_hidden_layers: int = 8, seed: int = 0, tokenizer_dir=None) -> Path:
    """A tiny random ``Qwen3_5ForCausalLM`` saved with its tokenizer under ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    out_dir = Path(out_dir)
    if tokenizer_dir is None:
        tokenizer = build_tokenizer(out_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.save_pretrained(str(out_dir))
    torch.manual_seed(seed)
    config = tiny_qwen3_5_config(len(tokenizer), num_hidden_layers, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(out_dir))
    return out_dir


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def build_demo(root: str | Path, n_conversations: int = 300) -> tuple[Path, Path]:
    """Model dir and data file for the README's first command; reused when already built."""
    root = Path(root)
    model_dir, data_path = root / "tiny-qwen3_5", root / "conversations.jsonl"
    if not (model_dir / "config.json").exists():
        build_model(model_dir)
    if not data_path.exists():
        write_jsonl(make_conversations(n_conversations, seed=2), data_path)
    return model_dir, data_path


def demo_config(root: Path, model_dir: Path, data: Path, shards: int) -> RunConfig:
    """The demo's job: the tiny model on CPU in float32, DFlash layers and the final state (so every export format
    and training schema the docs show works on it), small batches, everything under ``root``."""
    return RunConfig(
        model=str(model_dir),
        data=(str(data),),  # as `--data` gives it
        output=str(root / "output"),
        run_dir=str(root / "run"),
        layers="dflash",
        final_state=True,
        device="cpu",
        dtype="float32",
        shards=shards,
        max_length=1024,
        max_tokens_per_batch=4096,
        max_rows=64,
        staging=str(root / "staging"),
    )


def run_command(cfg: RunConfig) -> str:
    """The ``hsextract run`` command that runs ``cfg``: each option whose value is not its default, as the config
    holds it (paths as given: a plan records them, so another spelling of a path would be another plan). The demo
    prints it, so that what it sets (dtype, final state, lengths, staging) is seen."""
    words = ["hsextract", "run"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("cli") not in ("job", "run") or value == f.default or value is None:
            continue
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag[2:]}")
            continue
        for item in (
            value if isinstance(value, tuple) else (value,)
        ):  # a tuple: the option given once per item
            words += [flag, str(item)]
    return shlex.join(words)


def job_lines(cfg: RunConfig) -> str:
    """What the demo says before it runs: the command, and the shorter one that repeats it."""
    config = Path(cfg.run_dir) / "config.json"
    if config.is_relative_to(Path.cwd()):
        config = config.relative_to(Path.cwd())
    return (
        f"running: {run_command(cfg)}\n"
        f"(`hsextract run --config {config}` repeats it: the run dir keeps its options in config.json)"
    )
