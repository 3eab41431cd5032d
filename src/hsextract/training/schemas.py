"""What one sample of an output becomes for each trainer: the one place that says it.

``record(s)`` is what the trainer's offline file holds (what ``hsextract export`` writes); ``item(record, ...)``
is what the trainer's own dataset yields from it (what ``StatesDataset`` yields). Export and training both call
these, so a file of the export and an item of the dataset never differ; ``skip_reason`` leaves out, for both, the
samples a trainer's loader cannot take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hsextract.errors import HsextractError

if TYPE_CHECKING:
    import torch

IGNORE_TOKEN_ID = -100

"""The label ModelOpt (transformers' ``LabelSmoother.ignore_index``) gives the last position."""


def has_consecutive_loss_tokens(loss_mask) -> bool:
    """SpecForge's DFlash loader condition (``has_consecutive_supervised_tokens``), on a numpy array or a CPU
    tensor (finalize decides it without torch, the datasets on what they read)."""
    m = np.asarray(loss_mask).astype(bool)
    return bool((m[:-1] & m[1:]).any()) if m.size > 1 else False


def by_name(*named) -> dict:
    """A registry of schemas or formats, by their ``name``."""
    return {n.name: n for n in named}


def _dspark_record(s: dict, ids_dtype: str, mask_dtype: str) -> dict:
    """The DSpark caches' four tensors, the tokens and their mask as ``torch.<dtype>``."""
    import torch

    return {
        "input_ids": s["input_ids"].to(getattr(torch, ids_dtype)),
        "loss_mask": s["loss_mask"].to(getattr(torch, mask_dtype)),
        "target_hidden_states": s["hidden_states"],
        "target_last_hidden_states": s["final_hidden_state"],
    }


class Schema:
    """One trainer's per-sample dict. Subclasses say what a sample becomes and what the output must hold."""

    name: str
    needs_final_state = True
    preset: str | None = None
    """The layer preset this trainer reads (layers.py): what it is served from an output of several."""

    def problem(self, layer_ids, final_state: bool) -> str | None:
        """Why states of ``layer_ids`` (the ones served), with the final state or not, cannot serve this trainer;
        None when they can. The one rule behind the export's refusal and what dry-run and run say before the
        capture (``served_by``)."""
        if self.needs_final_state and not final_state:
            return "needs the final hidden state: extract with --final-state (implied by the eagle3 and dspark presets)"
        return None

    def check(self, manifest: dict, layer_ids=None) -> None:
        """Refuse an output this trainer cannot use, before anything is read or written (``layer_ids``: the ones
        served, by default every captured one)."""
        ids = list(manifest["layer_ids"] if layer_ids is None else layer_ids)
        if problem := self.problem(ids, bool(manifest.get("final_state"))):
            raise HsextractError(f"this output cannot serve {self.name}, which {problem}")

    def layers_for(self, manifest: dict, layers):
        """The layers to serve: those asked for; from an output of several presets, this trainer's own; else every
        captured layer (None), as an output of one preset or of explicit ids holds just what was asked for."""
        presets = manifest.get("presets") or {}
        if layers is not None or len(presets) <= 1:
            return layers
        if self.preset in presets:
            return self.preset
        example = next(iter(presets))
        raise HsextractError(
            f"this output holds the layers of several presets ({', '.join(presets)}): say which ones {self.name} "
            f"reads: --layers {example} on `hsextract export`, layers={example!r} in Python (a preset the output "
            "records, or ids in the order wanted)"
        )

    @property
    def verdicts(self) -> str:
        """The name its ``skip_reason`` verdicts are kept under in the sample index: one per distinct rule."""
        return self.name

    def skip_reason(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str | None:
        """Why a sample cannot be served, decided from its tokens alone (dataset and export agree on it)."""
        return None

    def record(self, s: dict) -> dict:
        """What the trainer's offline file for this sample holds."""
        raise NotImplementedError

    def item(self, record: dict, s: dict) -> dict:
        """What the trainer's own dataset yields from ``record`` (``s``: the reader dict it was made from)."""
        return record

    def served(self, s: dict) -> dict:
        """The item the training datasets serve for the reader dict ``s``."""
        return self.item(self.record(s), s)


class Raw(Schema):
    """The reader's own dict (output/reader.py), unchanged."""

    name = "raw"
    needs_final_state = False

    def layers_for(self, manifest, layers):
        """Every captured layer unless told: the reader's dict serves any drafter's, a union's included."""
        return layers

    def record(self, s):
        return s


class SpecForgeDFlash(Schema):
    """``torch.load`` of SpecForge's DFlash ``data_I.ckpt`` (``normalize_offline_sample`` runs in its loader)."""

    name = "specforge-dflash"
    needs_final_state = False
    preset = "dflash"

    def skip_reason(self, input_ids, loss_mask):
        if not has_consecutive_loss_tokens(loss_mask):
            return "fewer than two consecutive loss tokens (SpecForge's DFlash loader raises on these)"
        return None

    def record(self, s):
        return {
            "input_ids": s["input_ids"].long(),
            "loss_mask": s["loss_mask"].long(),
            "hidden_states": s["hidden_states"],
        }

    def item(self, record, s):
        """The record plus its ``sample_id``, so that a loop can log which samples a batch held (the collators keep
        it as a list; SpecForge's normalizers read only their own keys). Not in the exported file."""
        return {**record, "sample_id": s["sample_id"]}


class SpecForgeDFlash2(SpecForgeDFlash):
    """SpecForge's DFlash-family ``data_I.ckpt`` (the same record and loader as DFlash) with DFlash 2's layers."""

    name = "specforge-dflash2"
    preset = "dflash2"


class SpecForgeDSpark(SpecForgeDFlash):
    """``torch.load`` of SpecForge's DSpark ``data_I.ckpt`` (``normalize_dspark_offline_sample`` in its loader):
    DFlash's keys plus ``target_last_hidden_states`` [T, H], the final state after the norm."""

    name = "specforge-dspark"
    needs_final_state = True
    preset = "dspark"

    def record(self, s):
        return {**super().record(s), "target_last_hidden_states": s["final_hidden_state"]}


class DeepSpecDSpark(Schema):
    """An item of DeepSpec's ``TargetCacheDataset`` (``deepspec/data/target_cache_dataset.py``), what its
    ``CacheCollator`` pads: ``input_ids`` int32 [T], ``loss_mask`` uint8 [T], ``target_hidden_states`` [T, k*H] (its
    hooks' layer outputs in id order), ``target_last_hidden_states`` [T, H] (the model's ``last_hidden_state``, after
    the norm)."""

    name = "deepspec-dspark"
    preset = "dspark"

    def record(self, s):
        return _dspark_record(s, "int32", "uint8")


class NemoDSpark(Schema):
    """One sample of NeMo Automodel's DSpark offline cache (``datasets/llm/dspark_cache.py``, ``CACHE_KEYS``):
    ``input_ids`` and ``loss_mask`` int64 [T], ``target_hidden_states`` [T, k*H], ``target_last_hidden_states``
    [T, H] after the norm. Its ``CachedDSparkDataset`` yields them padded to the cache's ``seq_length`` (zeros, no
    loss): the item pads to ``seq_length`` when one is given (``NemoDSpark(seq_length=4096)``) and refuses longer
    samples, since the cache cannot hold them."""

    name = "nemo-dspark"
    preset = "dspark"
    KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")

    def __init__(self, seq_length: int | None = None):
        self.seq_length = seq_length

    @property
    def verdicts(self) -> str:
        """Each ``seq_length`` leaves out other samples (the index written at finalize holds those of none)."""
        return self.name if self.seq_length is None else f"{self.name}:seq_length={self.seq_length}"

    def skip_reason(self, input_ids, loss_mask):
        if self.seq_length is not None and len(input_ids) > self.seq_length:
            return f"longer than the cache's seq_length {self.seq_length}"
        return None

    def record(self, s):
        return _dspark_record(s, "int64", "int64")

    def item(self, record, s=None):
        if self.seq_length is None:
            return record
        return {k: pad_rows(record[k], self.seq_length) for k in self.KEYS}


def pad_rows(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` [T, ...] with zero rows appended up to ``length``."""
    out = t.new_zeros((length, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


class SpecForgeEagle3(Schema):
    """``torch.load`` of SpecForge's EAGLE-3 ``data_I.ckpt``: the final state after the norm (it applies only the
    frozen lm_head), exactly 3 captured layers."""

    name = "specforge-eagle3"
    preset = "eagle3"

    def problem(self, layer_ids, final_state):
        ids = list(layer_ids)
        if len(ids) != 3:
            return (
                f"needs exactly 3 captured layers (SpecForge's EAGLE-3 reads aux_hidden_state [1, T, 3H]), not "
                f"{len(ids)} ({ids}): extract with --layers eagle3 or three ids, or serve three of them (layers=)"
            )
        return super().problem(ids, final_state)

    def record(self, s):
        return {
            "input_ids": s["input_ids"].long(),
            "loss_mask": s["loss_mask"].long(),
            "aux_hidden_state": s["hidden_states"].unsqueeze(0),
            "hidden_state": s["final_hidden_state"].unsqueeze(0),
        }

    item = SpecForgeDFlash.item


class Speculators(Schema):
    """``hs_I.safetensors`` (``token_ids``, ``hidden_states`` [T, k+1, H], the last slot the final state BEFORE the
    norm: speculators applies the verifier norm itself); the item is ``ArrowDataset[I]``."""

    name = "speculators"

    def record(self, s):
        import torch

        states = torch.stack(
            [s["layers"][k] for k in sorted(s["layers"])] + [s["final_hidden_state_prenorm"]], dim=1
        )
        return {"hidden_states": states.contiguous(), "token_ids": s["input_ids"].long().contiguous()}

    def item(self, record, s):
        """``ArrowDataset._get_raw_data`` + ``BaseDataset.__getitem__``; the loss mask is the table's row (int64)."""
        import torch

        states, ids = record["hidden_states"], record["token_ids"]
        return {
            "hidden_states": states[:, :-1].flatten(1),
            "input_ids": ids,
            "verifier_last_hidden_states": states[:, -1],
            "loss_mask": s["loss_mask"].long(),
            "lengths": torch.tensor([ids.shape[0]], dtype=torch.long),
            "position_ids": torch.arange(ids.shape[0], dtype=torch.long),
        }


class ModelOpt(Schema):
    """``torch.load`` of ModelOpt's ``conv_I.pt``; the item is ``OfflineSupervisedDataset[I]`` with
    ``answer_only_loss=True`` (the stored mask) or ``False`` (all ones)."""

    name = "modelopt"

    def __init__(self, answer_only_loss: bool = True):
        self.answer_only_loss = answer_only_loss

    def record(self, s):
        return {
            "input_ids": s["input_ids"].long(),
            "hidden_states": s["final_hidden_state"],
            "aux_hidden_states": s["hidden_states"],
            "loss_mask": s["loss_mask"].long(),
            "conversation_id": s["sample_id"],
        }

    def item(self, record, s=None):
        import torch

        ids = record["input_ids"]
        labels = torch.full_like(ids, IGNORE_TOKEN_ID)
        labels[..., :-1] = ids[..., 1:]
        if self.answer_only_loss:
            loss_mask = record["loss_mask"].to(ids.dtype)
        else:
            loss_mask = torch.ones_like(ids)
        return {
            "input_ids": ids,
            "base_model_hidden_states": record["hidden_states"],
            "aux_hidden_states": record["aux_hidden_states"],
            "attention_mask": torch.ones_like(ids),
            "loss_mask": loss_mask,
            "labels": labels,
            "base_hidden_prenorm": bool(record.get("hidden_states_prenorm", False)),
        }


SCHEMAS: dict[str, Schema] = by_name(
    Raw(),
    SpecForgeDFlash(),
    SpecForgeDFlash2(),
    SpecForgeDSpark(),
    SpecForgeEagle3(),
    Speculators(),
    ModelOpt(),
    DeepSpecDSpark(),
    NemoDSpark(),
)


def served_by(layer_ids, final_state: bool, presets: dict | None = None) -> dict[str, str | None]:
    """Each trainer's format (``raw`` aside) -> None when a capture of ``layer_ids`` (recording ``presets``),
    with the final state or not, serves it, else why not: each is served its own preset where the capture
    records it, else every captured layer, as the export and the training datasets serve them."""
    presets = presets or {}
    return {
        name: schema.problem(presets.get(schema.preset) or layer_ids, final_state)
        for name, schema in SCHEMAS.items()
        if name != "raw"
    }


def served_lines(served: dict[str, str | None]) -> list[str]:
    """``served_by`` for the console: the formats served on one line, those not served grouped by reason."""
    ok = [name for name, problem in served.items() if problem is None]
    lines = [f"serves: {', '.join(ok) or 'no trainer format'} (hsextract export --format, training datasets)"]
    reasons: dict[str, list[str]] = {}
    for name, problem in served.items():
        if problem is not None:
            reasons.setdefault(problem, []).append(name)
    lines += [f"does not serve {', '.join(names)}: {problem}" for problem, names in reasons.items()]
    return lines


def get_schema(schema: str | Schema) -> Schema:
    """A schema by name (``raw``, ``specforge-dflash``, ``specforge-dflash2``, ``specforge-dspark``,
    ``specforge-eagle3``, ``speculators``, ``modelopt``, ``deepspec-dspark``, ``nemo-dspark``)."""
    if isinstance(schema, Schema):
        return schema
    if schema not in SCHEMAS:
        raise HsextractError(f"schema {schema!r} is not one of {', '.join(SCHEMAS)}")
    return SCHEMAS[schema]
