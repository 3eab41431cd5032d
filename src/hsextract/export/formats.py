"""One class per trainer's offline format: where each sample's record (training/schemas.py, shared with the training
dataset) goes and how it is serialized into the files the trainer's own loader reads."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import torch

from hsextract.errors import HsextractError
from hsextract.training.schemas import SCHEMAS, NemoDSpark, Schema, by_name

FILE_GROUP = 2000  # samples per subdirectory, as SpecForge's prepare_hidden_states.py groups them


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _own(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes: ``torch.save`` of a view writes the view's whole storage."""
    return t.contiguous().clone()


def _ids(ids) -> str:
    """A list as one shell word: ``[1,31,60]``."""
    return json.dumps(list(ids), separators=(",", ":"))


def _group(index: int) -> str:
    g = index // FILE_GROUP * FILE_GROUP
    return f"rows_{g}-{g + FILE_GROUP}"


def _records_bytes(record: dict) -> bytes:
    """A schema's record as ``torch.save`` writes it, every tensor owning exactly its bytes."""
    return _torch_bytes({k: _own(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()})


class ExportFormat:
    """One trainer's offline layout: the schema (training/schemas.py) says what a sample's record is, the format
    where it goes and how it is serialized, plus the whole-export files the trainer reads."""

    schema: Schema
    vocab_files: tuple[str, ...] = ()
    per_sample = True
    """Files per sample, written batch file by batch file; else the format writes its own (export/nemo.py)."""

    @property
    def name(self) -> str:
        return self.schema.name

    def check(self, manifest: dict, layer_ids=None) -> None:
        try:
            self.schema.check(manifest, layer_ids)
        except HsextractError as e:
            raise HsextractError(f"--format {self.name}: {e}") from None

    def sample_files(self, index: int, s: dict) -> dict[str, bytes]:
        raise NotImplementedError

    def vocab_mapping_files(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, bytes]:
        raise NotImplementedError

    def finish(self, dest, rows, workdir: str) -> None:
        """Whole-export files beyond the statistics, from ``rows``: (index, input_ids, loss_mask) of every exported
        sample in index order, which this must consume (the token statistics are counted as it goes)."""
        for _ in rows:
            pass

    def train_hint(self, manifest: dict, dest: str, draft_vocab: int | None) -> dict:
        """The trainer's command for this export, with the real model, DEST and given sizes filled in: the
        installed command where the trainer has one, else ``setup`` says where the script lives."""
        raise NotImplementedError


class SpecForge(ExportFormat):
    """SpecForge's offline ``data_I.ckpt`` files, one per sample in groups of ``FILE_GROUP``; its DFlash, DFlash 2,
    DSpark and EAGLE-3 recipes differ in the schema, the recipe and where the layer ids go."""

    DFLASH_RECIPE = "examples/configs/qwen3-8b-dflash-offline.yaml"

    def __init__(
        self, schema: str, where: str, recipe: str = DFLASH_RECIPE, reads_vocab_mapping: bool = True
    ):
        self.schema = SCHEMAS[schema]
        self.where = where
        """Where the layer ids go in the trainer's config, ``{ids}`` standing for them as one shell word."""
        self.recipe = recipe
        self.reads_vocab_mapping = reads_vocab_mapping
        """Whether the recipe takes ``model.vocab_mapping_path`` (added when a draft vocab is made)."""

    def sample_files(self, index, s):
        return {f"{_group(index)}/data_{index}.ckpt": _records_bytes(self.schema.record(s))}

    def vocab_mapping_files(self, d2t, t2d):
        return {"vocab_mapping.pt": _torch_bytes({"d2t": d2t, "t2d": t2d})}

    def train_hint(self, manifest, dest, draft_vocab):
        ids = list(manifest["layer_ids"])
        command = (
            f"specforge train --config {self.recipe} "
            f"model.target_model_path={_model(manifest)} data.hidden_states_path={dest}"
        )
        if self.reads_vocab_mapping:
            command += _vocab_path(dest, draft_vocab)
        return {
            "layer_ids": ids,
            "where": self.where.format(ids=_ids(ids)),
            "command": command,
            "setup": f"pip install specforge; the recipe {self.recipe} is sgl-project/SpecForge's (the package "
            "ships none): run from a checkout or copy it. Loading one file: docs/EXPORT.md",
        }


_DFLASH_WHERE = 'draft model config: "dflash_config": {{"target_layer_ids": {ids}}}'


class Speculators(ExportFormat):
    schema = SCHEMAS["speculators"]

    def sample_files(self, index, s):
        from safetensors.torch import save

        return {f"hidden_states/hs_{index}.safetensors": save(self.schema.record(s))}

    def vocab_mapping_files(self, d2t, t2d):
        import numpy as np

        def npy(a) -> bytes:
            buf = io.BytesIO()
            np.save(buf, a.numpy())
            return buf.getvalue()

        n = d2t.numel()
        return {f"d2t-{n}.npy": npy(d2t), f"t2d-{n}.npy": npy(t2d)}

    def finish(self, dest, rows, workdir):
        """The ``datasets`` table, streamed row by row into an Arrow file, then saved as ``save_to_disk`` lays it
        out, in torch format (speculators compares its ``input_ids`` with each file's ``token_ids`` as tensors)."""
        import datasets
        from datasets.arrow_writer import ArrowWriter

        features = datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("int64")),
                "loss_mask": datasets.Sequence(datasets.Value("int64")),
                "seq_len": datasets.Value("int64"),
            }
        )
        table = os.path.join(workdir, "rows.arrow")
        with ArrowWriter(features=features, path=table) as writer:
            for expected, (index, ids, mask) in enumerate(rows):
                if index != expected:  # row I must be hs_I: speculators maps them by position
                    raise HsextractError(f"speculators export: sample {index} came as row {expected}")
                writer.write(
                    {"input_ids": ids.tolist(), "loss_mask": mask.long().tolist(), "seq_len": len(ids)}
                )
            writer.finalize()
        ds = datasets.Dataset.from_file(table)
        ds.set_format(type="torch")
        local = os.path.join(workdir, "dataset")
        ds.save_to_disk(local)
        for name in sorted(os.listdir(local)):
            dest.put_file(Path(local) / name, name)

    def train_hint(self, manifest, dest, draft_vocab):
        ids = [k + 1 for k in manifest["layer_ids"]]
        return {
            "layer_ids": ids,
            "where": "--target-layer-ids (speculators counts the INPUT of layer k: hsextract's ids + 1; the final "
            "state it appends itself is the last slot of every hs file)",
            "command": f"speculators train --verifier-name-or-path {_model(manifest)} --data-path {dest} "
            f"--on-missing raise --target-layer-ids {' '.join(map(str, ids))}"
            + (f" --draft-vocab-size {draft_vocab}" if draft_vocab else ""),
        }


class ModelOpt(ExportFormat):
    schema = SCHEMAS["modelopt"]

    def sample_files(self, index, s):
        return {f"conversations/{_group(index)}/conv_{index}.pt": _records_bytes(self.schema.record(s))}

    def vocab_mapping_files(self, d2t, t2d):
        return {"d2t.pt": _torch_bytes(d2t)}

    def train_hint(self, manifest, dest, draft_vocab):
        ids = list(manifest["layer_ids"])
        return {
            "layer_ids": ids,
            "where": "eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids (EAGLE-3); ModelOpt's DFlash "
            "derives its ids from the layer counts and must match them",
            "command": "./launch_train.sh --config modelopt_recipes/general/speculative_decoding/eagle3.yaml "
            f"model.model_name_or_path={_model(manifest)} data.offline_data_path={dest}/conversations "
            + (f"data.draft_vocab_cache={dest}/d2t.pt " if draft_vocab else "")
            + "training.answer_only_loss=true "
            f"'eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids={_ids(ids)}'",
            "setup": "launch_train.sh is in examples/speculative_decoding of a NVIDIA/Model-Optimizer checkout "
            "(pip's nvidia-modelopt installs no training command); run it there",
        }


class NemoDSparkCache(ExportFormat):
    """NeMo Automodel's DSpark offline cache: shards and a manifest, written by export/nemo.py."""

    schema = SCHEMAS["nemo-dspark"]
    per_sample = False

    def schema_for(self, seq_length: int) -> NemoDSpark:
        return NemoDSpark(seq_length=seq_length)

    def write_cache(self, dest, index, reader, **options) -> int:
        from hsextract.export.nemo import write_cache

        return write_cache(dest, index, reader, **options)

    def vocab_mapping_files(self, d2t, t2d):
        raise HsextractError("--draft-vocab: NeMo's DSpark drafter predicts over the full target vocabulary")

    def train_hint(self, manifest, dest, draft_vocab):
        ids = list(manifest["layer_ids"])
        return {
            "layer_ids": ids,
            "where": f"recipe_args.target_layer_ids: {_ids(ids)} and recipe_args.cached_target_path: {dest} in "
            "NeMo Automodel's DSpark recipe for this target (examples/speculative/dspark/), seq_length as the "
            "cache's; target_weights.safetensors beside the shards: docs/EXPORT.md",
            "command": "torchrun -m nemo_automodel.recipes.llm.train_dspark -c dspark-recipe.yaml "
            f"--recipe_args.cached_target_path {dest} --model.pretrained_model_name_or_path {_model(manifest)}",
        }


def _model(manifest: dict) -> str:
    """The target model the output was extracted from, as the run was given it."""
    return str(manifest.get("fingerprint", {}).get("model") or "")


def _vocab_path(dest: str, draft_vocab: int | None) -> str:
    return f" model.vocab_mapping_path={dest}/vocab_mapping.pt" if draft_vocab else ""


FORMATS: dict[str, ExportFormat] = by_name(
    SpecForge("specforge-dflash", _DFLASH_WHERE),
    SpecForge("specforge-dflash2", _DFLASH_WHERE),
    SpecForge(
        "specforge-dspark",
        "the DSpark draft config's target_layer_ids: {ids} (SpecForge ships no DSpark recipe: start from its DFlash "
        "offline one)",
        reads_vocab_mapping=False,
    ),
    SpecForge(
        "specforge-eagle3",
        "aux_hidden_state_layer_ids: {ids} under model: in a copy of the recipe YAML (or "
        "eagle_config.eagle_aux_hidden_state_layer_ids in the draft config; a dotted override does not parse a "
        "list here)",
        recipe="examples/configs/qwen3.5-35b-a3b-eagle3-offline.yaml",
    ),
    Speculators(),
    ModelOpt(),
    NemoDSparkCache(),
)


def vocab_mapping(token_freq: dict[int, int], draft_vocab: int, target_vocab: int):
    """``(d2t, t2d)``: the ``draft_vocab`` most frequent tokens (ties to the lower id), padded with the lowest unused
    ids; ``d2t[i] = token - i`` over the chosen tokens in ascending order, ``t2d[token] = True`` for each."""
    if not 0 < draft_vocab <= target_vocab:
        raise HsextractError(
            f"--draft-vocab {draft_vocab} must be in 1..{target_vocab} (the target vocabulary)"
        )
    chosen = sorted(token_freq, key=lambda t: (-token_freq[t], t))[:draft_vocab]
    taken = set(chosen)
    t = 0
    while len(chosen) < draft_vocab:
        if t not in taken:
            chosen.append(t)
        t += 1
    chosen.sort()
    d2t = torch.tensor(chosen, dtype=torch.long) - torch.arange(draft_vocab, dtype=torch.long)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d
