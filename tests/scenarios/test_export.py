"""``hsextract export``: a DFlash run and an EAGLE-3 run of the tiny model, exported to every format and loaded
through each trainer's own loading code (SpecForge 0.2.0, speculators 0.9.0, nvidia-modelopt 0.47.0; installed by
``scripts/setup.sh --test``). Every value is compared with a plain unbatched HF forward in float32, never with
hsextract's reader; sample order comes from the manifest file itself.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from support.cli import TINY_LIMITS, cli_run_args, run_cli, write_mixed_dataset
from support.s3server import S3Endpoint

from hsextract.errors import HsextractError
from hsextract.export.formats import FORMATS, vocab_mapping
from hsextract.export.runner import export

pytestmark = pytest.mark.slow


def needs(module: str):
    """The trainer packages come from ``scripts/setup.sh --test``; an older venv skips these tests, saying so."""
    return pytest.importorskip(module, reason=f"{module} is not installed: run scripts/setup.sh --test")


TOL = {"rtol": 1e-4, "atol": 1e-4}
DRAFT_VOCAB = 50


# -- runs and the independent reference ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer) -> Path:
    root = tmp_path_factory.mktemp("export-data")
    return write_mixed_dataset(root / "data.jsonl", tiny_tokenizer, n_chat=12)


def _run(root: Path, model, data, **options) -> Path:
    run_cli(
        *cli_run_args(root, model, data, shards=1, num_proc=1, no_progress=True, **TINY_LIMITS, **options)
    )
    return root / "out"


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory, tiny_model, dataset) -> Path:
    """The DFlash preset (5 layers of the 8-layer model: 1..5) with the final state."""
    return _run(tmp_path_factory.mktemp("dflash-run"), tiny_model, dataset, layers="dflash", final_state=True)


@pytest.fixture(scope="module")
def eagle3_run(tmp_path_factory, tiny_model, dataset) -> Path:
    """The EAGLE-3 preset (1, 3, 4), which implies the final state."""
    return _run(tmp_path_factory.mktemp("eagle3-run"), tiny_model, dataset, layers="eagle3")


def manifest_order(output: Path) -> list[str]:
    manifest = json.loads((output / "manifest.json").read_text())
    return [sid for b in manifest["batches"] for sid in b["sample_ids"]]


def rows_by_id(dataset: Path) -> dict:
    """The pre-tokenized rows of the dataset, by id."""
    return {row["id"]: row for row in map(json.loads, open(dataset)) if "input_ids" in row}


@pytest.fixture(scope="module")
def hf(tiny_lm):
    """HF ``output_hidden_states`` (index k+1 = output of layer k, [-1] after the final norm) and the last layer's
    raw output from a forward hook, for one unbatched sample."""
    cache: dict = {}

    def forward(input_ids) -> dict:
        key = tuple(int(t) for t in input_ids)
        if key not in cache:
            raw = {}
            last = tiny_lm.model.layers[-1]
            hook = last.register_forward_hook(
                lambda m, a, o: raw.__setitem__("prenorm", (o[0] if isinstance(o, tuple) else o)[0])
            )
            try:
                with torch.inference_mode():
                    hs = tiny_lm(torch.tensor([key]), output_hidden_states=True).hidden_states
            finally:
                hook.remove()
            cache[key] = {"hs": [h[0] for h in hs], "prenorm": raw["prenorm"]}
        return cache[key]

    return forward


def concat_layers(ref: dict, layer_ids) -> torch.Tensor:
    return torch.cat([ref["hs"][k + 1] for k in layer_ids], dim=-1)


def check_ids_and_mask(sample_id: str, input_ids, loss_mask, rows: dict) -> None:
    """Pre-tokenized rows of the dataset keep their ids and mask exactly."""
    if sample_id in rows:
        assert [int(t) for t in input_ids] == rows[sample_id]["input_ids"]
        assert [int(m) for m in loss_mask] == rows[sample_id]["loss_mask"]


def exported(output: Path, tmp_path: Path, fmt: str, **options) -> Path:
    dest = tmp_path / fmt
    export(str(output), str(dest), fmt, num_proc=1, show_progress=False, echo=lambda *_: None, **options)
    return dest


# -- SpecForge ----------------------------------------------------------------------------------------------------
def test_specforge_dflash_export_loads_through_specforge(dflash_run, dataset, hf, tmp_path):
    needs("specforge")
    from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
    from specforge.data.loss_mask import has_consecutive_supervised_tokens
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    # The CLI, with two processes, as a user runs it.
    dest = tmp_path / "sf-dflash"
    run_cli("export", dflash_run, dest, "--format", "specforge-dflash", "--num-proc", 2, "--no-progress")
    order, rows = manifest_order(dflash_run), rows_by_id(dataset)
    info = json.loads((dest / "export.json").read_text())
    layer_ids = info["source"]["layer_ids"]
    assert layer_ids == [1, 2, 3, 4, 5] and info["train_with"]["layer_ids"] == layer_ids
    files = list_feature_files(str(dest))
    assert len(files) == info["samples_exported"] == len(order) - info["samples_skipped"]
    seen = set()
    for path in files:
        index = int(Path(path).name.removeprefix("data_").removesuffix(".ckpt"))
        sample = normalize_offline_sample(load_feature_file(path), max_len=4096)
        ids, mask, states = sample["input_ids"][0], sample["loss_mask"][0], sample["hidden_states"][0]
        check_ids_and_mask(order[index], ids, mask, rows)
        torch.testing.assert_close(states, concat_layers(hf(ids), layer_ids), **TOL)
        seen.add(order[index])
    # Left out: exactly the samples SpecForge's loader raises on.
    skipped = set(info["skipped"])
    assert skipped and skipped == set(order) - seen
    for sid in skipped:
        row = rows[sid]  # only pre-tokenized rows can lack two consecutive assistant tokens
        assert not has_consecutive_supervised_tokens(torch.tensor(row["loss_mask"]))
        with pytest.raises(ValueError, match="consecutive"):
            n = len(row["input_ids"])
            normalize_offline_sample(
                {
                    "input_ids": torch.tensor(row["input_ids"]),
                    "loss_mask": torch.tensor(row["loss_mask"]),
                    "hidden_states": torch.zeros(n, 5),
                },
                max_len=4096,
            )


def test_specforge_eagle3_export_loads_through_specforge(eagle3_run, dataset, hf, tmp_path):
    needs("specforge")
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    dest = exported(eagle3_run, tmp_path, "specforge-eagle3", draft_vocab=DRAFT_VOCAB)
    order, rows = manifest_order(eagle3_run), rows_by_id(dataset)
    files = list_feature_files(str(dest))
    assert len(files) == len(order)
    counts: Counter = Counter()
    for path in files:
        index = int(Path(path).name.removeprefix("data_").removesuffix(".ckpt"))
        raw = load_feature_file(path)
        sample = normalize_offline_sample(raw, max_len=4096)
        ids = sample["input_ids"][0]
        check_ids_and_mask(order[index], ids, raw["loss_mask"], rows)
        ref = hf(ids)
        torch.testing.assert_close(sample["hidden_state"][0], concat_layers(ref, [1, 3, 4]), **TOL)
        # The target EAGLE-3 distils from: HF's last entry, after the final norm.
        torch.testing.assert_close(sample["target"][0], ref["hs"][-1], **TOL)
        counts.update(ids[raw["loss_mask"].bool()].tolist())
    token_freq = torch.load(dest / "token_freq.pt", weights_only=True)
    assert token_freq == dict(counts)
    mapping = torch.load(dest / "vocab_mapping.pt", weights_only=True)
    vocab = json.loads((eagle3_run / "manifest.json").read_text())["vocab_size"]
    d2t, t2d = process_token_dict_to_mappings(Counter(dict(sorted(counts.items()))), DRAFT_VOCAB, vocab)
    assert torch.equal(mapping["d2t"], d2t) and torch.equal(mapping["t2d"], t2d)


def test_specforge_eagle3_needs_exactly_three_layers(dflash_run, tmp_path):
    with pytest.raises(HsextractError, match="exactly 3 captured layers"):
        exported(dflash_run, tmp_path, "specforge-eagle3")
    assert not (tmp_path / "specforge-eagle3").exists()  # refused before anything is written


# -- speculators --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["dflash_run", "eagle3_run"])
def test_speculators_export_loads_through_arrow_dataset(run, request, dataset, hf, tmp_path):
    needs("speculators.train.data")
    import numpy as np
    from speculators.train.data import ArrowDataset
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    output = request.getfixturevalue(run)
    dest = exported(output, tmp_path, "speculators", draft_vocab=DRAFT_VOCAB)
    manifest = json.loads((output / "manifest.json").read_text())
    layer_ids = manifest["layer_ids"]
    info = json.loads((dest / "export.json").read_text())
    assert info["train_with"]["layer_ids"] == [k + 1 for k in layer_ids]  # speculators: input of layer k
    order, rows = manifest_order(output), rows_by_id(dataset)
    data = ArrowDataset(4096, dest, on_missing="raise")
    assert len(data) == len(order)
    for i in range(len(data)):
        sample = data[i]
        ids = sample["input_ids"]
        check_ids_and_mask(order[i], ids, sample["loss_mask"], rows)
        ref = hf(ids)
        torch.testing.assert_close(sample["hidden_states"], concat_layers(ref, layer_ids), **TOL)
        # The final state BEFORE the norm: speculators norms it itself (verifier_norm).
        torch.testing.assert_close(sample["verifier_last_hidden_states"], ref["prenorm"], **TOL)
    freq = torch.load(dest / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, manifest["vocab_size"])
    assert np.array_equal(np.load(dest / f"d2t-{DRAFT_VOCAB}.npy"), d2t.numpy())
    assert np.array_equal(np.load(dest / f"t2d-{DRAFT_VOCAB}.npy"), t2d.numpy())


# -- ModelOpt -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["dflash_run", "eagle3_run"])
def test_modelopt_export_loads_through_offline_supervised_dataset(run, request, dataset, hf, tmp_path):
    needs("modelopt.torch.speculative.eagle.utils")
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    output = request.getfixturevalue(run)
    dest = exported(output, tmp_path, "modelopt", draft_vocab=DRAFT_VOCAB)
    layer_ids = json.loads((output / "manifest.json").read_text())["layer_ids"]
    order, rows = manifest_order(output), rows_by_id(dataset)
    # What ModelOpt's eagle_utils does with data.offline_data_path: every *.pt below it.
    files = sorted(str(p) for p in (dest / "conversations").rglob("*.pt"))
    assert len(files) == len(order)
    data = OfflineSupervisedDataset(files, answer_only_loss=True)
    for i in range(len(data)):
        sample = data[i]
        sid = torch.load(files[i], weights_only=True)["conversation_id"]
        assert sid in order
        ids = sample["input_ids"]
        check_ids_and_mask(sid, ids, sample["loss_mask"], rows)
        ref = hf(ids)
        torch.testing.assert_close(sample["base_model_hidden_states"], ref["hs"][-1], **TOL)
        torch.testing.assert_close(sample["aux_hidden_states"], concat_layers(ref, layer_ids), **TOL)
        assert torch.equal(sample["labels"][:-1], ids[1:])
        assert sample["base_hidden_prenorm"] is False
    batch = EagleOfflineDataCollator(train_len=64)([data[0], data[1]])
    assert batch["base_model_outputs"]["aux_hidden_states"].shape == (2, 64, 64 * len(layer_ids))
    d2t = torch.load(dest / "d2t.pt", weights_only=True)
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_VOCAB,)


# -- the draft vocabulary -----------------------------------------------------------------------------------------
def test_vocab_mapping_equals_specforge_and_speculators():
    needs("specforge")
    needs("speculators.train.vocab_mapping")
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (3000,), generator=g)
    counts = Counter(dict(sorted(Counter(ids.tolist()).items())))
    for draft in (16, 200, 390, 500):  # ties among counts; more draft slots than tokens seen (padding)
        d2t, t2d = vocab_mapping(dict(counts), draft, 600)
        a = process_token_dict_to_mappings(Counter(counts), draft, 600)
        b = build_vocab_mappings_from_distribution(dict(counts), draft, 600)
        for other in (a, b):
            assert torch.equal(d2t, other[0]) and torch.equal(t2d, other[1]), draft
        assert torch.equal(torch.arange(draft) + d2t, t2d.nonzero().flatten())


# -- resume, refusal, S3 ------------------------------------------------------------------------------------------
def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "export.json"
    }


def test_interrupted_export_resumes_to_the_same_files_and_nothing_half_written(
    eagle3_run, tmp_path, monkeypatch
):
    reference = exported(eagle3_run, tmp_path / "reference", "modelopt")
    fmt = FORMATS["modelopt"]
    calls = {"n": 0}
    real = type(fmt).sample_files

    def dies_midway(self, index, s):
        calls["n"] += 1
        if calls["n"] > 7:
            raise KeyboardInterrupt  # as a Ctrl-C or a kill between two files would stop it
        return real(self, index, s)

    monkeypatch.setattr(type(fmt), "sample_files", dies_midway)
    dest = tmp_path / "cut" / "modelopt"
    with pytest.raises(KeyboardInterrupt):
        export(str(eagle3_run), str(dest), "modelopt", num_proc=1, show_progress=False, echo=lambda *_: None)
    assert not (dest / "export.json").exists()
    done = list((dest / ".hsextract-export" / "done").glob("*.json"))
    assert 0 < len(done) < len(json.loads((eagle3_run / "manifest.json").read_text())["batches"])
    # A write cut short by a kill leaves only a temporary name behind (atomic writes); the rerun clears it.
    leftover = next((dest / "conversations").rglob("*.pt"))
    (leftover.parent / (leftover.name + ".tmp-123-456")).write_bytes(b"half")
    monkeypatch.undo()

    export(str(eagle3_run), str(dest), "modelopt", num_proc=1, show_progress=False, echo=lambda *_: None)
    assert (dest / "export.json").exists()
    assert _files(dest) == _files(reference)


def test_export_refuses_to_mix_with_another_export_or_foreign_files(eagle3_run, dflash_run, tmp_path):
    dest = exported(eagle3_run, tmp_path, "specforge-dflash")
    before = _files(dest)
    with pytest.raises(
        HsextractError, match="holds another export: format: specforge-dflash there, modelopt now"
    ):
        export(str(eagle3_run), str(dest), "modelopt", show_progress=False)
    with pytest.raises(
        HsextractError, match=r"holds another export: source output \(its plan\): \w+ there, \w+ now"
    ):
        export(str(dflash_run), str(dest), "specforge-dflash", show_progress=False)
    # Through the CLI: the fields that differ in words, no Python dict.
    r = run_cli("export", eagle3_run, dest, "--format", "specforge-dflash", "--draft-vocab", 10, check=False)
    assert r.returncode == 2 and "--draft-vocab: none there, 10 now" in r.stderr, r.stderr
    assert "{" not in r.stderr, r.stderr
    assert _files(dest) == before
    # The same export again: already complete, nothing rewritten.
    lines = []
    export(str(eagle3_run), str(dest), "specforge-dflash", show_progress=False, echo=lines.append)
    assert "already holds this export" in lines[0]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(HsextractError, match="not empty"):
        export(str(eagle3_run), str(foreign), "modelopt", show_progress=False)


@pytest.mark.usefixtures("aws_test_env")
def test_export_from_s3_to_s3_equals_the_local_export(eagle3_run, s3: S3Endpoint, s3_bucket, tmp_path):
    local = exported(eagle3_run, tmp_path / "local", "speculators", draft_vocab=DRAFT_VOCAB)
    client = s3.client()
    for path in sorted(eagle3_run.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), s3_bucket, f"out/{path.relative_to(eagle3_run).as_posix()}")
    export(
        f"s3://{s3_bucket}/out",
        f"s3://{s3_bucket}/exported",
        "speculators",
        draft_vocab=DRAFT_VOCAB,
        num_proc=2,
        endpoint_url=s3.url,
        show_progress=False,
        echo=lambda *_: None,
    )
    keys = [k for k in s3.object_keys(s3_bucket) if k.startswith("exported/")]
    remote = {k.removeprefix("exported/"): s3.get_object(s3_bucket, k) for k in keys}
    remote.pop("export.json")
    local_files = _files(local)
    # The datasets table is written fresh each time; its bytes may carry a fingerprint, its rows may not differ.
    for name in ("state.json", "dataset_info.json"):
        remote.pop(name), local_files.pop(name)
    assert remote == local_files


def test_reader_final_state_is_hf_last_entry_and_the_last_layers_raw_output(eagle3_run, hf):
    """The EAGLE-3 run stores the last layer (7) as a 4th slot; the reader derives the normed state from it."""
    from hsextract.output import open_output

    out = open_output(eagle3_run, dtype=torch.float32)
    assert out.layout.slot_layers == (1, 3, 4, 7) and out.layout.final_slot == 3
    assert out.manifest["final_state"]["norm"]["rule"] == "one_plus_weight"  # Qwen3.5's RMSNorm: 1 + weight
    for sample in out:
        ref = hf(sample["input_ids"])
        torch.testing.assert_close(sample["final_hidden_state"], ref["hs"][-1], **TOL)
        torch.testing.assert_close(sample["final_hidden_state_prenorm"], ref["prenorm"], **TOL)
        assert sample["hidden_states"].shape[1] == 3 * 64  # the captured layers only


@pytest.mark.parametrize(
    ("fmt", "given"),
    [
        ("speculators", "--draft-vocab-size 50"),
        ("specforge-eagle3", "model.vocab_mapping_path={dest}/vocab_mapping.pt"),
        ("modelopt", "data.draft_vocab_cache={dest}/d2t.pt"),
    ],
)
def test_export_prints_the_trainer_command_with_real_paths_and_the_given_sizes_and_no_bars(
    eagle3_run, tmp_path, tiny_model, fmt, given
):
    """The hints said MODEL and DEST and dropped --draft-vocab; --no-progress still printed datasets' bars."""
    dest = tmp_path / "exported"
    r = run_cli("export", eagle3_run, dest, "--format", fmt, "--draft-vocab", DRAFT_VOCAB, "--no-progress")
    command = next(line for line in r.stdout.splitlines() if line.startswith("train with: "))
    assert str(tiny_model) in command and str(dest) in command, command
    assert given.format(dest=dest) in command, command
    assert "MODEL" not in command and "DEST" not in command and "YOUR" not in command, command
    assert "%|" not in r.stdout + r.stderr, r.stderr  # no progress bar of any library
    assert (
        json.loads((dest / "export.json").read_text())["train_with"]["command"]
        == command[len("train with: ") :]
    )
