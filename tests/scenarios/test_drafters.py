"""Every drafter from one extraction: a union of presets (``--layers dflash,dflash2,dspark,eagle3``) of a 64-layer
tiny model serves each drafter's items equal, tensor for tensor, to a separate extraction with that preset alone,
and to an independent unbatched HF forward (layer k = ``hidden_states[k + 1]``, the final state after the norm =
``last_hidden_state``). The union's NeMo Automodel DSpark cache and SpecForge DSpark files load through those
trainers' own loaders and collators (nemo-automodel 0.7.0, specforge 0.2.0: ``scripts/setup.sh --test``).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from support.cli import TINY_LIMITS, cli_run_args, run_cli
from support.output import write_output

from hsextract.container import read_file_head
from hsextract.training import StatesMapDataset
from hsextract.training.schemas import NemoDSpark

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # five extractions of a 64-layer model on CPU

PRESETS = ("dflash", "dflash2", "dspark", "eagle3")


IDS = {
    "dflash": [1, 16, 31, 46, 61],
    "dflash2": [5, 19, 33, 47, 61],
    "dspark": [1, 16, 31, 46, 61],
    "eagle3": [1, 31, 60],
}

"""Each preset's ids for 64 layers, written out: the test does not compute them the way the code does."""


SCHEMAS = {
    "dflash": ["specforge-dflash"],
    "dflash2": ["specforge-dflash2"],
    "dspark": ["specforge-dspark", "deepspec-dspark", "nemo-dspark"],
    "eagle3": ["specforge-eagle3"],
}

"""The schemas that read each preset's layers."""


REL_TOL = 1e-4

"""Relative L2 error allowed against the unbatched forward, per layer (dry-run's float32 tolerance): 61 random layers
let single values drift by ~1e-4, while neighbouring layers differ by 30-50%, so an off-by-one still fails."""


def assert_layers_close(got: torch.Tensor, ref: dict, layer_ids) -> None:
    """``got`` [T, k*H] against HF's ``hidden_states[k + 1]`` for each id, one layer at a time."""
    for chunk, k in zip(got.chunk(len(layer_ids), dim=-1), layer_ids, strict=True):
        assert_close(chunk, ref["hs"][k + 1], f"layer {k}")


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    got, want = got.double(), want.double()
    err = ((got - want).norm() / want.norm()).item()
    assert got.shape == want.shape and err <= REL_TOL, (what, tuple(got.shape), err)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory, tiny_model):
    """The tiny qwen3_5 shape with 64 decoder layers, as many as Qwen3.6-27B: the presets' real ids."""
    from hsextract.demo import build_model

    return build_model(tmp_path_factory.mktemp("tiny-64"), num_hidden_layers=64, tokenizer_dir=tiny_model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, deep_model) -> dict[str, Path]:
    """One union run of the CLI and one extraction per preset over the same 6 conversations cut to 96 tokens (one
    shard). Each preset alone is extracted in this process by the project's own steps (``support/output.py``:
    preparation, the pipeline's forward, the batch writer, finalize; tests/scenarios/test_end_to_end.py holds them
    byte-identical to the CLI's run), which saves four launches of a 64-layer model."""
    from hsextract.demo import make_conversations

    root = tmp_path_factory.mktemp("drafters")
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in make_conversations(6, seed=3)) + "\n")
    limits = {**TINY_LIMITS, "max_length": 96}
    args = cli_run_args(
        root / "union", deep_model, data, layers=",".join(PRESETS), num_proc=1, no_progress=True, **limits
    )
    run_cli(*args, timeout=900)
    outputs = {"union": root / "union" / "out"}
    for name in PRESETS:
        outputs[name] = write_output(root / name, deep_model, data, layers=name, shards=1, **limits)
    return outputs


@pytest.fixture(scope="module")
def hf(deep_model):
    """An independent unbatched forward of one sample: HF ``hidden_states`` and ``last_hidden_state``."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(deep_model), dtype=torch.float32).eval()
    cache: dict = {}

    def forward(input_ids) -> dict:
        key = tuple(int(t) for t in input_ids)
        if key not in cache:
            with torch.inference_mode():
                out = lm.model(torch.tensor([key]), output_hidden_states=True)
            cache[key] = {"hs": [h[0] for h in out.hidden_states], "last": out.last_hidden_state[0]}
        return cache[key]

    return forward


def items_by_id(output: Path, schema) -> dict[str, dict]:
    data = StatesMapDataset(output, schema, dtype=torch.float32)
    return {sid: data[i] for i, sid in enumerate(data.sample_ids)}


def test_union_records_every_preset_in_its_manifest_and_each_file(runs):
    union = runs["union"]
    manifest = json.loads((union / "manifest.json").read_text())
    assert manifest["presets"] == IDS
    assert manifest["layer_ids"] == sorted({k for ids in IDS.values() for k in ids})
    assert manifest["slot_layer_ids"][-1] == 63 and manifest["final_state"]["slot"] == 10
    for path in union.glob("shard-*/*.safetensors"):
        meta = json.loads(read_file_head(path)[8:])["__metadata__"]
        assert json.loads(meta["presets"]) == IDS
    for name in PRESETS:
        alone = json.loads((runs[name] / "manifest.json").read_text())
        assert alone["presets"] == {name: IDS[name]} and alone["layer_ids"] == IDS[name]
        assert bool(alone["final_state"]) == (name in ("dspark", "eagle3"))


@pytest.mark.parametrize("preset", PRESETS)
def test_union_serves_each_drafter_what_its_own_extraction_serves(runs, preset):
    for schema in SCHEMAS[preset]:
        from_union, alone = items_by_id(runs["union"], schema), items_by_id(runs[preset], schema)
        assert from_union.keys() == alone.keys() and alone
        for sid, item in alone.items():
            got = from_union[sid]
            assert got.keys() == item.keys()
            for key, value in item.items():  # sample_id (SpecForge's items) is a string
                same = got[key] == value if isinstance(value, str) else torch.equal(got[key], value)
                assert same, (schema, sid, key)


@pytest.mark.parametrize("preset", PRESETS)
def test_union_items_equal_an_unbatched_hf_forward(runs, hf, preset):
    """The raw reader dict with the preset's layers, against HF: layer k is hidden_states[k + 1], the final state
    after the norm is last_hidden_state."""
    data = StatesMapDataset(runs["union"], "raw", dtype=torch.float32, layers=preset)
    assert data.index.layer_ids == tuple(IDS[preset])
    for i in range(len(data)):
        s = data[i]
        ref = hf(s["input_ids"])
        assert_layers_close(s["hidden_states"], ref, IDS[preset])
        assert list(s["layers"]) == IDS[preset]
        assert_close(s["final_hidden_state"], ref["last"], "final state")


def nemo_dspark_cache():
    """NeMo Automodel's own ``dspark_cache`` module. Its package ``datasets/llm/__init__.py`` imports every dataset
    of the package (one needs Pillow); the cache module itself needs only torch and safetensors."""
    pytest.importorskip(
        "nemo_automodel", reason="nemo-automodel is not installed: run scripts/setup.sh --test"
    )
    import nemo_automodel.components.datasets as datasets_pkg

    name = "nemo_automodel.components.datasets.llm"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(Path(datasets_pkg.__file__).parent / "llm")]
        sys.modules[name] = package
    from nemo_automodel.components.datasets.llm import dspark_cache

    return dspark_cache


def test_nemo_dspark_cache_loads_through_nemo_automodels_loader(runs, hf, tmp_path):
    from hsextract.export.runner import export

    dspark_cache = nemo_dspark_cache()
    dest = tmp_path / "nemo"
    info = export(
        str(runs["union"]),
        str(dest),
        "nemo-dspark",
        seq_length=300,
        shard_size=3,
        show_progress=False,
        echo=lambda *_: None,
    )
    assert info["train_with"]["layer_ids"] == IDS["dspark"]
    manifest = dspark_cache.read_manifest(str(dest))
    assert manifest["target_layer_ids"] == IDS["dspark"] and manifest["target_hidden_dim"] == 5 * 64
    model_type = json.loads((Path(manifest["target_model"]) / "config.json").read_text())["model_type"]
    assert manifest["seq_length"] == 300 and manifest["target_model_type"] == model_type
    assert manifest["num_hidden_layers"] == 64 and manifest["dtype"] == "fp32"
    data = dspark_cache.CachedDSparkDataset(str(dest))
    order = [
        sid
        for b in json.loads((runs["union"] / "manifest.json").read_text())["batches"]
        for sid in b["sample_ids"]
    ]
    assert len(data) == len(order) == 6 and len(list(dest.glob("shard-*.safetensors"))) == 2
    loader = dspark_cache.build_cached_dspark_dataloader(cache_dir=str(dest), batch_size=2, shuffle=False)
    batches = list(loader)
    assert batches[0]["target_hidden_states"].shape == (2, 300, 5 * 64)
    raw = items_by_id(runs["dspark"], "raw")
    padded = items_by_id(runs["dspark"], NemoDSpark(seq_length=300))
    for i, sid in enumerate(order):
        item = {k: v[i % 2] for k, v in batches[i // 2].items()}
        ids = raw[sid]["input_ids"]
        n = len(ids)
        assert torch.equal(item["input_ids"][:n], ids) and not item["input_ids"][n:].any()
        assert not item["loss_mask"][n:].any() and not item["target_hidden_states"][n:].any()
        ref = hf(ids)
        assert_layers_close(item["target_hidden_states"][:n], ref, IDS["dspark"])
        assert_close(item["target_last_hidden_states"][:n], ref["last"], "final state")
        for key in item:  # the union's cache equals what the dspark extraction serves, padded as NeMo pads
            assert torch.equal(item[key], padded[sid][key]), (sid, key)


def test_specforge_dspark_export_loads_through_specforges_normalizer_and_collator(runs, hf, tmp_path):
    pytest.importorskip("specforge", reason="specforge is not installed: run scripts/setup.sh --test")
    from specforge.algorithms.common.dflash_family_data import (
        build_dspark_collator,
        normalize_dspark_offline_sample,
    )
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    dest = tmp_path / "sf-dspark"
    run_cli("export", runs["union"], dest, "--format", "specforge-dspark", "--num-proc", 1, "--no-progress")
    info = json.loads((dest / "export.json").read_text())
    assert info["source"]["layer_ids"] == IDS["dspark"]
    samples = [
        normalize_dspark_offline_sample(load_feature_file(p), max_len=4096)
        for p in list_feature_files(str(dest))
    ]
    assert len(samples) == info["samples_exported"] > 0
    batch = build_dspark_collator()(samples[:2])
    assert batch["target_last_hidden_states"].shape[-1] == 64 and batch["hidden_states"].shape[-1] == 5 * 64
    for s in samples:
        ids = s["input_ids"][0]
        ref = hf(ids)
        assert_layers_close(s["hidden_states"][0], ref, IDS["dspark"])
        assert_close(s["target_last_hidden_states"][0], ref["last"], "final state")
