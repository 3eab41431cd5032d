"""Layer ids: presets, parsing and validation against the model's depth, what each id captures."""

from __future__ import annotations

from hsextract.errors import HsextractError

PRESETS = ("dflash", "eagle3")


def dflash_layer_ids(num_layers: int, num_targets: int = 5) -> tuple[int, ...]:
    """DFlash's default: ``num_targets`` ids evenly spaced from 1 to N-3, rounded ([1, 16, 31, 46, 61] for 64)."""
    start, end = 1, num_layers - 3
    if num_targets == 1 or end <= start:
        return (start,)
    ids = [round(start + i * (end - start) / (num_targets - 1)) for i in range(num_targets)]
    return tuple(sorted(set(ids)))


def eagle3_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default in the output convention: low, middle and high layers."""
    return tuple(sorted({1, num_layers // 2 - 1, num_layers - 4}))


def parse_layers(spec) -> tuple[int, ...] | str:
    """``"dflash"``, ``"eagle3"``, ``"1,16,31"`` or a sequence of ints."""
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s in PRESETS:
            return s
        try:
            return tuple(int(x) for x in s.replace(" ", "").split(",") if x)
        except ValueError:
            raise HsextractError(
                f"--layers {spec!r} is neither a preset ({', '.join(PRESETS)}) nor comma-separated integers"
            ) from None
    return tuple(int(x) for x in spec)


def resolve_layer_ids(spec, num_layers: int) -> tuple[int, ...]:
    """Concrete, sorted, checked layer ids for a model with ``num_layers`` decoder layers."""
    spec = parse_layers(spec)
    if spec == "dflash":
        ids = dflash_layer_ids(num_layers)
    elif spec == "eagle3":
        ids = eagle3_layer_ids(num_layers)
    else:
        ids = spec
    if not ids:
        raise HsextractError("--layers is empty: name at least one decoder layer id")
    if len(set(ids)) != len(ids):
        raise HsextractError(f"--layers {list(ids)} repeats an id")
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise HsextractError(
            f"layer id(s) {bad} out of range: the model has {num_layers} decoder layers, ids 0..{num_layers - 1} "
            f"(id k = OUTPUT of decoder layer k = HF output_hidden_states[k+1]; vLLM-style 'input of layer k' "
            f"ids are one higher)"
        )
    return tuple(sorted(ids))


def describe_layer(k: int, num_layers: int) -> dict:
    """What id ``k`` means in each convention users meet."""
    return {
        "layer_id": k,
        "captures": f"output of decoder layer {k} (pre-final-norm)",
        "hf_output_hidden_states_index": k + 1,
        "hf_index_matches_exactly": k + 1 < num_layers,  # HF's last entry has the final norm applied
        "vllm_input_of_layer_id": k + 1,
    }


def layer_types(text_config) -> list[str]:
    types = getattr(text_config, "layer_types", None)
    return list(types) if types else ["full_attention"] * text_config.num_hidden_layers
