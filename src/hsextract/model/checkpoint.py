"""What a local checkpoint directory must hold before anything is prepared: a tokenizer and whole weight files.

transformers builds an empty tokenizer from a directory with only a config (every row then fails, blamed on the
data), and a missing or cut-short weight file surfaces only when a worker loads it, after preparation, where a
rerun cannot fix it. Both are said here, from file names, sizes and safetensors headers alone: no import, no
tensor read. The caller gives a local directory (a Hub id is resolved to its cached snapshot first).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hsextract.container import HEADER_LENGTH_BYTES, header_json, read_file_head
from hsextract.errors import HsextractError
from hsextract.hub import WEIGHT_SUFFIXES, broken_link

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.txt",
    "tekken.json",
)

"""Any one of these (or ``vocab.json`` with ``merges.txt``, or a ``*.tiktoken`` file) is a tokenizer's vocabulary."""


WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def check_checkpoint(
    model_dir: str | Path, *, weights: bool = True, tokenizer: str | Path | None = None
) -> None:
    """Refuse a local model directory without a tokenizer (or the ``--tokenizer`` directory ``tokenizer``, when one
    is given, without one), or (``weights``) without every weight file whole, naming what is missing. Anything but a
    directory is left to the config's own check."""
    if tokenizer is not None and Path(tokenizer).is_dir():
        if (problem := missing_tokenizer(Path(tokenizer))) is not None:
            raise HsextractError(f"--tokenizer {tokenizer}: {problem}")
    root = Path(model_dir)
    if not root.is_dir():
        return
    if tokenizer is None and (problem := missing_tokenizer(root)) is not None:
        raise HsextractError(f"--model {root}: {problem}")
    if weights and (problem := missing_weights(root) or fp8_layout_problem(root)) is not None:
        raise HsextractError(f"--model {root}: {problem}")


def _holds(root: Path) -> str:
    names = sorted(p.name + (" (a broken link)" if broken_link(p) else "") for p in root.iterdir())
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"it holds {shown}" if names else "it is empty"


def missing_tokenizer(root: Path) -> str | None:
    """Why ``root`` has no tokenizer, or None when it has one."""
    if any((root / name).is_file() for name in TOKENIZER_FILES) or any(root.glob("*.tiktoken")):
        return None
    if (root / "vocab.json").is_file():
        if (root / "merges.txt").is_file():
            return None
        return "has vocab.json but no merges.txt: the tokenizer is incomplete; copy merges.txt from the checkpoint"
    if _remote_tokenizer(root):
        return None  # a tokenizer class of the checkpoint's own code (trust_remote_code) finds its own files
    return (
        f"has no tokenizer: none of {', '.join(TOKENIZER_FILES[:2])}, vocab.json + merges.txt, vocab.txt or "
        f"*.tiktoken is there ({_holds(root)}). Copy the tokenizer's files (tokenizer.json, tokenizer_config.json) "
        "from the checkpoint the weights came from into it"
    )


def _remote_tokenizer(root: Path) -> bool:
    try:
        config = json.loads((root / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    return isinstance(auto_map, dict) and "AutoTokenizer" in auto_map


def missing_weights(root: Path) -> str | None:
    """Why ``root``'s weights cannot load (no file, a file its index names absent, a safetensors file cut short),
    or None when they are all there."""
    for index_name in WEIGHT_INDEXES:
        index = root / index_name
        if not index.is_file():
            continue
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index_name} is not a weight index (no readable weight_map): download it again"
        absent = [n for n in names if not (root / n).is_file()]
        if broken := [n for n in absent if broken_link(root / n)]:
            return f"{broken[0]} {broken_link(root / broken[0])}{_more(broken)}"
        if absent:
            shown = ", ".join(absent[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
            return (
                f"{len(absent)} of the {len(names)} weight files {index_name} names are missing ({shown}): "
                "the download is incomplete; fetch them into the directory"
            )
        return _first_cut_short(root / n for n in names)
    for name in WEIGHT_FILES:
        if (root / name).is_file():
            return _first_cut_short([root / name])
    for name in WEIGHT_FILES + WEIGHT_INDEXES:
        if (problem := broken_link(root / name)) is not None:
            return f"{name} {problem}"
    return (
        f"has no weights: none of {', '.join(WEIGHT_FILES + WEIGHT_INDEXES)} is there ({_holds(root)}). "
        "Give the checkpoint's directory, or download its weights into this one"
    )


def _first_cut_short(paths) -> str | None:
    for path in paths:
        if path.suffix == ".safetensors" and (problem := safetensors_problem(path)) is not None:
            return f"{path.name} {problem}: the download is incomplete or the file damaged; fetch it again"
    return None


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's header or length, read from its header alone; None if whole."""
    size = path.stat().st_size
    if size < HEADER_LENGTH_BYTES:
        return f"has {size} bytes, not even a header"
    try:
        head = read_file_head(path, _Unreadable)
        header = header_json(head, _Unreadable)
        end = max(
            (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
            default=0,
        )
    except _Unreadable as e:
        return str(e)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "has no readable safetensors header"
    if size < len(head) + end:
        return f"has {size:,} bytes of the {len(head) + end:,} its header describes"
    return None


ONE_BYTE_DTYPES = ("F8_E4M3", "F8_E5M2", "I8", "U8")

"""A ``*.weight`` of one of these is quantized: its values are the weights only together with a scale."""


FP8_BLOCK = 128


def fp8_layout_problem(root: Path) -> str | None:
    """Why ``root``'s quantized weights would not compute as served, or None. Which linears are fp8 is read from the
    weights' own dtypes (safetensors headers), never from the config alone: every 1-byte weight has an e4m3 dtype
    and a ``weight_scale_inv`` of one value per 128x128 tile, every scale has such a weight, and scales are there
    exactly when ``config.json`` says fp8. A weight without its scale would run on its raw e4m3 values, and scales
    the config does not announce would be dropped by transformers' loader: either is states off by orders of
    magnitude."""
    from hsextract.model.fp8_load import SCALE_SUFFIX, quantization_config, weight_files

    tensors = {}
    for path in weight_files(str(root)):
        if path.suffix == ".safetensors":
            try:
                header = header_json(read_file_head(path, _Unreadable), _Unreadable)
            except _Unreadable as e:
                return f"{path.name} {e}: the download is incomplete or the file damaged; fetch it again"
            tensors.update((k, (path.name, v)) for k, v in header.items() if k != "__metadata__")
    scaled = sorted(k.removesuffix(SCALE_SUFFIX) for k in tensors if k.endswith(SCALE_SUFFIX))
    quantized = sorted(
        k for k, (_, t) in tensors.items() if k.endswith(".weight") and t["dtype"] in ONE_BYTE_DTYPES
    )
    has_scale = set(scaled)
    unscaled = [k for k in quantized if k.removesuffix(".weight") not in has_scale]
    if unscaled:
        name, (file, t) = unscaled[0], tensors[unscaled[0]]
        return (
            f"{name} (in {file}) is a 1-byte {t['dtype']} weight but the checkpoint has no "
            f"{name.removesuffix('.weight')}{SCALE_SUFFIX} for it{_more(unscaled)}: without its scale its raw values "
            "are not the weights. Fetch the checkpoint's weight files again (or use its bf16 checkpoint)"
        )
    for module in scaled:
        weight = tensors.get(f"{module}.weight")
        scale_file, scale = tensors[module + SCALE_SUFFIX]
        if weight is None or weight[1]["dtype"] != "F8_E4M3":
            what = f"is {weight[1]['dtype']}" if weight else "is not in the checkpoint"
            return (
                f"{module}{SCALE_SUFFIX} (in {scale_file}) scales {module}.weight, which {what}: hsextract computes "
                "e4m3 (F8_E4M3) weights with their scales only. Fetch the checkpoint's weight files again"
            )
        rows, cols = (list(weight[1]["shape"]) + [1, 1])[:2]
        tiles = [-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)]
        if list(scale["shape"]) != tiles:
            return (
                f"{module}{SCALE_SUFFIX} (in {scale_file}) has shape {list(scale['shape'])}, not one scale per "
                f"128x128 tile of its [{rows}, {cols}] weight ({tiles}): hsextract computes Qwen3.x-FP8's "
                "layout only. Use the bf16 checkpoint"
            )
    qc = quantization_config(str(root))
    says_fp8 = isinstance(qc, dict) and qc.get("quant_method") == "fp8"
    if scaled and not says_fp8:
        said = (
            f"a quantization_config of quant_method {qc.get('quant_method')!r}"
            if qc
            else "no quantization_config"
        )
        return (
            f"{scaled[0]}.weight is an fp8 weight with its scale {scaled[0]}{SCALE_SUFFIX}{_more(scaled)}, but "
            f"config.json has {said}: the scales would be dropped on load. Put back the checkpoint's own "
            'config.json (its quantization_config has quant_method "fp8")'
        )
    if says_fp8 and not scaled:
        return (
            "config.json's quantization_config says fp8 but no weight file holds an fp8 weight with its "
            f"'*{SCALE_SUFFIX}' scale: the config is not these weights'. Put back the checkpoint's own config.json"
        )
    return None


def _more(names: list) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


class _Unreadable(Exception):
    """What is wrong with a header, said by the codec (container.py)."""


SAMPLES_PER_WEIGHT_FILE = 16
SAMPLE_BYTES = 1 << 16


def weights_fingerprint(model_dir: Path) -> str:
    """A cheap hash that changes when the weights do: per weight file its name, size, and 16 x 64 KiB spread over
    it (header included): a few reads per file instead of the whole weights, and any retrained or re-saved checkpoint
    differs in the sampled bytes. Empty for a hub id or a config-only directory."""
    if not model_dir.is_dir():
        return ""
    h = hashlib.sha256()
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(SAMPLES_PER_WEIGHT_FILE):
                f.seek(max(0, size - SAMPLE_BYTES) * i // (SAMPLES_PER_WEIGHT_FILE - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]
