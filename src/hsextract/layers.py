"""Layer ids: presets, unions of presets, parsing and validation against the model's depth, what each id captures.

Every id is the OUTPUT of decoder layer k (0-based) = HF ``output_hidden_states[k + 1]``, the convention of DFlash,
SpecForge, ModelOpt, NeMo Automodel and DeepSpec (vLLM and speculators count the input: ours + 1). Each
preset's function names its rule and source (``dspark`` is DFlash's ids and the final state); a union captures
every id once, in one forward, and the output records each preset's ids.
"""

from __future__ import annotations

from hsextract.errors import HsextractError

PRESETS = ("dflash", "dflash2", "dspark", "eagle3")


FINAL_STATE_PRESETS = ("dspark", "eagle3")

"""Presets whose trainers read the final state after the norm (the output then stores the last layer's output)."""


def dflash_layer_ids(num_layers: int, num_targets: int = 5) -> tuple[int, ...]:
    """DFlash's default: ``num_targets`` ids evenly spaced from 1 to N-3, rounded ([1, 16, 31, 46, 61] for 64;
    z-lab ``build_target_layer_ids``, NeMo Automodel ``draft_qwen3.py``)."""
    start, end = 1, num_layers - 3
    if num_targets == 1 or end <= start:
        return (start,)
    ids = [round(start + i * (end - start) / (num_targets - 1)) for i in range(num_targets)]
    return tuple(sorted(set(ids)))


def dflash2_layer_ids(num_layers: int, num_targets: int = 5) -> tuple[int, ...]:
    """DFlash 2's published ids: ``num_targets`` ending at N-3, ``round(N / (num_targets - 0.5))`` apart
    ([5, 19, 33, 47, 61] for 64): the rule every published config fits (z-lab ``dflash2-config.json``, NeMo
    Automodel's ``qwen3*_dflash2.yaml``); DFlash's rule where that would start below layer 1."""
    end = num_layers - 3
    step = round(num_layers / (num_targets - 0.5))
    start = end - (num_targets - 1) * step
    if num_targets == 1 or step < 1 or start < 1:
        return dflash_layer_ids(num_layers, num_targets)
    return tuple(range(start, end + 1, step))


def eagle3_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default in the output convention: low, middle and high layers."""
    return tuple(sorted({1, num_layers // 2 - 1, num_layers - 4}))


def preset_layer_ids(name: str, num_layers: int) -> tuple[int, ...]:
    """The layer ids (without the final state) of one preset for a model with ``num_layers`` decoder layers."""
    if name in ("dflash", "dspark"):
        return dflash_layer_ids(num_layers)
    if name == "dflash2":
        return dflash2_layer_ids(num_layers)
    if name == "eagle3":
        return eagle3_layer_ids(num_layers)
    raise HsextractError(f"{name!r} is not a layer preset ({', '.join(PRESETS)})")


def parse_layers(spec) -> tuple[int, ...] | str:
    """``"dflash"``, a union ``"dflash,dflash2,eagle3"`` (returned normalized: lower case, no repeats, in the
    order given), ``"1,16,31"`` or a sequence of ints."""
    if isinstance(spec, str):
        parts = [p for p in spec.strip().lower().replace(" ", "").split(",") if p]
        named = [p for p in parts if p in PRESETS]
        if named and len(named) == len(parts):
            return ",".join(dict.fromkeys(named))
        try:
            ids = tuple(int(x) for x in parts if x not in PRESETS)
        except ValueError:
            raise HsextractError(
                f"--layers {spec!r} is neither presets ({', '.join(PRESETS)}, joined by commas for a union) nor "
                "comma-separated integers"
            ) from None
        if named:
            raise HsextractError(
                f"--layers {spec!r} mixes presets and layer ids: give presets ({', '.join(PRESETS)}, joined by "
                "commas for a union) or integers, not both"
            )
        return ids
    return tuple(int(x) for x in spec)


def preset_names(spec) -> tuple[str, ...]:
    """The presets ``spec`` names, in the order given; none for explicit ids."""
    spec = parse_layers(spec)
    return tuple(spec.split(",")) if isinstance(spec, str) else ()


def presets_layer_ids(spec, num_layers: int) -> dict[str, list[int]]:
    """Each preset ``spec`` names -> its layer ids (final state not included), in the order given."""
    return {name: list(preset_layer_ids(name, num_layers)) for name in preset_names(spec)}


def implies_final_state(spec) -> bool:
    """Whether a preset named in ``spec`` reads the final state (``dspark``, ``eagle3``)."""
    return any(name in FINAL_STATE_PRESETS for name in preset_names(spec))


def resolve_layer_ids(spec, num_layers: int) -> tuple[int, ...]:
    """Concrete, sorted, checked layer ids for a model with ``num_layers`` decoder layers: for presets, the union
    of their ids, each once."""
    spec = parse_layers(spec)
    if isinstance(spec, str):
        ids = tuple(sorted({k for name in spec.split(",") for k in preset_layer_ids(name, num_layers)}))
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
