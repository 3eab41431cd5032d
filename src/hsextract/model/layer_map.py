"""``hsextract layers``: which ids each preset picks for a model, in hsextract's count and in vLLM's, from its
``config.json`` alone (a local directory, or the one file fetched from the Hub or its cache): no weights, no
tokenizer, no transformers import. The same rules (layers.py) pick the ids ``run`` captures."""

from __future__ import annotations

import json
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.hub import did_you_mean
from hsextract.layers import implies_final_state, parse_layers, presets_layer_ids, resolve_layer_ids

TEXT_CONFIGS = ("text_config", "language_config", "llm_config")

"""Where a multimodal checkpoint keeps its language model's config (Qwen3.5/3.6: ``text_config``)."""


def config_file(model: str, revision: str | None = None) -> Path:
    """The model's ``config.json``: in the directory ``model``, else the Hub id's, from the Hugging Face cache or
    downloaded (that file only)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HsextractError(
                f"--model {model}: directory has no config.json (is it a transformers checkpoint?)"
            )
        return path / "config.json"
    if path.exists() or model.count("/") != 1:
        raise HsextractError(
            f"--model {model}: no such directory, and not a Hub id of the form org/name either"
            + did_you_mean(model)
        )
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(hf_hub_download(model, "config.json", revision=revision))
    except RepositoryNotFoundError:
        raise HsextractError(
            f"--model {model}: no such model on the Hub (or it is private: log in)"
            + did_you_mean(model, constants.HF_HUB_CACHE)
        ) from None
    except LocalEntryNotFoundError:
        raise HsextractError(
            f"--model {model}: its config.json is not in the Hugging Face cache and the Hub cannot be reached "
            "(HF_HUB_OFFLINE=1 reads the cache only): download it once online, or give a local directory"
            + did_you_mean(model, constants.HF_HUB_CACHE)
        ) from None
    except HfHubHTTPError as e:
        raise HsextractError(f"--model {model}: the Hub refused config.json ({e})") from None


def num_layers_of(config: dict, where: str) -> int:
    """The decoder layer count of a config (its language model's, for a multimodal one)."""
    for text in (config, *(config.get(k) for k in TEXT_CONFIGS)):
        n = text.get("num_hidden_layers") if isinstance(text, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            return n
    raise HsextractError(f"{where} has no num_hidden_layers (nor in a text_config): is it a decoder LM?")


def layer_map(model: str, layers, revision: str | None = None) -> dict:
    """Each preset's ids (ours: the OUTPUT of decoder layer k; vLLM's and speculators': its input, ours + 1),
    whether it reads the final state, and the union a run with ``layers`` captures."""
    path = config_file(model, revision)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HsextractError(f"{path} is not readable JSON ({e})") from None
    n = num_layers_of(config if isinstance(config, dict) else {}, str(path))
    spec = parse_layers(layers)
    union = resolve_layer_ids(spec, n)
    rows = [
        {
            "preset": name,
            "layer_ids": ids,
            "vllm_ids": [k + 1 for k in ids],
            "final_state": implies_final_state(name),
        }
        for name, ids in presets_layer_ids(spec, n).items()
    ]
    final = implies_final_state(spec)
    return {
        "model": model,
        "config": str(path),
        "num_layers": n,
        "presets": rows,
        "union": {
            "layer_ids": list(union),
            "vllm_ids": [k + 1 for k in union],
            "final_state": final,
            "slots_per_token": len(union) + final,
        },
    }


def format_layer_map(m: dict) -> str:
    def ids(row: dict) -> str:
        final = " + the final state" if row["final_state"] else ""
        return f"{row['layer_ids']}{final}; vLLM/speculators: {row['vllm_ids']}"

    lines = [f"{m['model']}: {m['num_layers']} decoder layers ({m['config']})"]
    width = max((len(r["preset"]) for r in m["presets"]), default=0)
    lines += [f"  {r['preset']:<{width}}  {ids(r)}" for r in m["presets"]]
    u = m["union"]
    if len(m["presets"]) != 1:
        label = "union" if m["presets"] else "ids"
        lines.append(f"  {label}: {ids(u)}; {u['slots_per_token']} slots per token, each layer captured once")
    lines.append(
        "hsextract's ids (DFlash, SpecForge, ModelOpt) count the OUTPUT of decoder layer k = HF "
        "output_hidden_states[k + 1]; vLLM and speculators count its input (ours + 1)."
    )
    return "\n".join(lines)
