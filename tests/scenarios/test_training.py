"""``hsextract.training``: datasets over a real output, read by real DataLoader worker processes, from a local
directory and from the S3 server on loopback, fed into each trainer's own collator and loader code. References are
independent of the code under test: an unbatched HF forward for the values, ``hsextract export`` read by each
trainer's own loader for the items, and the manifest file itself for which samples exist.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import damage
from support.cli import TINY_LIMITS, cli_run_args, run_cli, write_mixed_dataset
from support.compare import assert_same
from support.s3server import S3Endpoint
from torch.utils.data import DataLoader

from hsextract.errors import CorruptOutputError, HsextractError
from hsextract.export.runner import export
from hsextract.output import open_output
from hsextract.storage.local import LocalSink
from hsextract.training import StatesDataset, StatesMapDataset

pytestmark = pytest.mark.slow


def ids_of(batch):
    return [s["sample_id"] for s in batch]


def manifest_order(output: Path) -> list[str]:
    manifest = json.loads((output / "manifest.json").read_text())
    return [sid for b in manifest["batches"] for sid in b["sample_ids"]]


def delivered(
    dataset: StatesDataset, workers: int, batch_size: int, stop_after: int | None = None
) -> list[str]:
    """Sample ids in the order a DataLoader with ``workers`` worker processes hands them to the training loop."""
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=ids_of)
    out = []
    for k, batch in enumerate(loader):
        if stop_after is not None and k == stop_after:
            break
        out += batch
    return out


@pytest.fixture(scope="module")
def output(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """One small EAGLE-3 run (layers 1, 3, 4 and the final state): every schema can read it."""
    root = tmp_path_factory.mktemp("training-run")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer, n_chat=10)
    run_cli(
        *cli_run_args(
            root, tiny_model, data, layers="eagle3", shards=1, num_proc=1, no_progress=True, **TINY_LIMITS
        )
    )
    return root / "out"


def exported(output: Path, tmp_path: Path, fmt: str, **options) -> Path:
    dest = tmp_path / fmt
    export(str(output), str(dest), fmt, num_proc=1, show_progress=False, echo=lambda *_: None, **options)
    return dest


# -- once per epoch, order, resume --------------------------------------------------------------------------------
def test_every_sample_once_per_epoch_across_two_ranks_of_two_workers(finished_run):
    out = finished_run[0] / "out"
    expected = manifest_order(out)

    def epoch(e: int, **kw) -> list[list[str]]:
        ranks = []
        for rank in range(2):
            data = StatesDataset(out, rank=rank, world_size=2, batch_size=3, seed=7, window_files=4, **kw)
            data.set_epoch(e)
            got = delivered(data, workers=2, batch_size=3)
            # The loader hands out exactly the rank's sequence, in order (what resume relies on).
            assert got == [data.sample_ids[i] for i in data.rank_sequence()]
            assert len(got) == len(data)
            ranks.append(got)
        return ranks

    first = epoch(0)
    assert sorted(first[0] + first[1]) == sorted(expected) and len(expected) == len(set(expected))
    assert abs(len(first[0]) - len(first[1])) <= 1
    assert first[0] + first[1] != expected  # shuffled
    second = epoch(1)
    assert sorted(second[0] + second[1]) == sorted(expected)
    assert second != first
    assert epoch(0) == first  # a rerun with the same seed: the same order
    assert sorted(sum(epoch(0, shuffle=False), [])) == sorted(expected)


def test_resume_from_a_mid_epoch_state_serves_exactly_the_rest(finished_run):
    out = finished_run[0] / "out"
    data = StatesDataset(out, rank=1, world_size=2, batch_size=2, seed=5)
    data.set_epoch(3)
    whole = delivered(data, workers=2, batch_size=2)
    head = delivered(data, workers=2, batch_size=2, stop_after=3)  # the job dies after 3 steps
    state = data.state_dict(consumed=len(head))
    assert state["epoch"] == 3 and state["consumed"] == 6

    resumed = StatesDataset(out, rank=1, world_size=2, batch_size=2, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    rest = delivered(resumed, workers=2, batch_size=2)
    assert head + rest == whole
    # Twice: a second interruption, counted on top of the first.
    again = StatesDataset(out, rank=1, world_size=2, batch_size=2, seed=5)
    again.load_state_dict(resumed.state_dict(consumed=4))
    assert delivered(again, workers=0, batch_size=2) == whole[10:]
    with pytest.raises(HsextractError, match="seed=5"):
        StatesDataset(out, rank=1, world_size=2, batch_size=2, seed=6).load_state_dict(state)


def test_without_workers_the_dataset_counts_what_it_served(finished_run):
    out = finished_run[0] / "out"
    data = StatesDataset(out, seed=2)
    it = iter(data)
    head = [next(it)["sample_id"] for _ in range(5)]
    resumed = StatesDataset(out, seed=2)
    resumed.load_state_dict(data.state_dict())
    assert head + [s["sample_id"] for s in resumed] == [data.sample_ids[i] for i in data.rank_sequence()]


def test_a_flipped_byte_raises_naming_the_file(finished_run, tmp_path):
    out = damage.copy_output(finished_run[0] / "out", tmp_path / "out")
    key = next(
        b["key"] for b in damage.manifest_batches(out)[1:] if len(b["sample_ids"]) > damage.DAMAGED_ROW
    )
    damage.flip_in_states(out / key)
    data = StatesDataset(out, shuffle=False)  # the index reads headers and index tensors only: still fine
    with pytest.raises(CorruptOutputError, match=f"{key}.*does not match its checksum"):
        delivered(data, workers=2, batch_size=2)
    with pytest.raises(CorruptOutputError, match=key):
        for _ in StatesMapDataset(out):
            pass


class CountingSink(LocalSink):
    """The output's directory, counting the reads made of it and their bytes."""

    reads = read_bytes = 0

    def read_range_into(self, key, offset, buffer, on_part=None):
        got = super().read_range_into(key, offset, buffer, on_part)
        self.reads, self.read_bytes = self.reads + 1, self.read_bytes + got
        return got


def test_runs_of_neighbouring_samples_are_read_together_into_shared_memory(finished_run):
    """In file order each worker takes runs of ``batch_size`` neighbouring rows: their states come in one read,
    into shared memory (the DataLoader sends a handle, not a copy), and equal the reader's read of each sample."""
    out = finished_run[0] / "out"
    reference = open_output(out)

    def in_the_worker(batch):  # the DataLoader's collate_fn runs in the worker, before the batch is sent
        return [(s, s["hidden_states"].is_shared()) for s in batch]

    data = StatesDataset(out, shuffle=False, batch_size=4)
    seen = [x for b in DataLoader(data, batch_size=4, num_workers=2, collate_fn=in_the_worker) for x in b]
    assert [s["sample_id"] for s, _ in seen] == manifest_order(out)
    assert all(shared for _, shared in seen)
    for s, _ in seen:
        want = reference[s["sample_id"]]
        for k in ("hidden_states", "input_ids", "loss_mask"):
            assert torch.equal(s[k], want[k]), (s["sample_id"], k)
    # Without workers the whole file is one run: per batch file, its header, its index with the token ids and
    # masks, and its states; every byte of the output read once at most.
    solo = StatesDataset(out, shuffle=False)
    counting = solo.reader().out.sink = CountingSink(out)
    assert [s["sample_id"] for s in solo] == manifest_order(out)
    files = damage.manifest_batches(out)
    assert counting.reads <= 3 * len(files) < len(solo)
    assert counting.read_bytes <= sum((out / b["key"]).stat().st_size for b in files)


# -- values -------------------------------------------------------------------------------------------------------
def test_values_equal_an_unbatched_hf_forward(output, tiny_lm):
    data = StatesMapDataset(output, "raw", dtype=torch.float32)
    assert data.lengths == [len(data[i]["input_ids"]) for i in range(len(data))]
    for i in range(0, len(data), 4):
        s = data[i]
        with torch.inference_mode():
            hs = tiny_lm(s["input_ids"][None], output_hidden_states=True).hidden_states
        for k in (1, 3, 4):
            torch.testing.assert_close(s["layers"][k], hs[k + 1][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s["final_hidden_state"], hs[-1][0], rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("aws_test_env")
def test_from_s3_on_loopback_equals_the_local_output(output, s3: S3Endpoint, s3_bucket):
    client = s3.client()
    for path in sorted(output.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), s3_bucket, f"run/{path.relative_to(output).as_posix()}")
    url = f"s3://{s3_bucket}/run"
    remote = StatesDataset(url, "modelopt", endpoint_url=s3.url, seed=4, threads=4)
    local = StatesDataset(output, "modelopt", seed=4)
    loader = DataLoader(remote, batch_size=None, num_workers=2)
    got = list(loader)
    want = list(local)
    assert len(got) == len(want) == len(manifest_order(output))
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]


# -- each trainer through its own seam, against its own loader on the export --------------------------------------
def needs(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed: run scripts/setup.sh --test")


def test_speculators_batches_from_the_output_equal_those_from_its_export(output, tmp_path):
    needs("speculators.train.data")
    from speculators.train.data import ArrowDataset, CollateFn

    from hsextract.training.speculators import OutputTransfer

    full = exported(output, tmp_path, "speculators")
    index = tmp_path / "index-only"
    run_cli("export", output, index, "--format", "speculators", "--index-only", "--no-progress")
    assert not (index / "hidden_states").exists()
    with pytest.raises(HsextractError, match="--index-only is for --format speculators"):
        exported(output, tmp_path, "modelopt", index_only=True)
    assert not (tmp_path / "modelopt").exists()  # refused before anything is written
    assert sum(p.stat().st_size for p in index.rglob("*") if p.is_file()) < 0.05 * sum(
        p.stat().st_size for p in full.rglob("*") if p.is_file()
    )
    theirs = ArrowDataset(4096, full, on_missing="raise")
    ours = ArrowDataset(4096, index, transfer=OutputTransfer(output), on_missing="raise")
    direct = StatesMapDataset(output, "speculators")
    assert len(ours) == len(theirs) == len(direct) == len(manifest_order(output))
    for i in range(len(theirs)):
        assert_same(ours[i], theirs[i], f"sample {i}")
        assert_same(direct[i], theirs[i], f"sample {i}")
    collate = CollateFn(max_len=256, hidden_size=64, num_target_layers=3, dtype=torch.float32)
    for a, b in zip(
        DataLoader(ours, batch_size=3, collate_fn=collate, num_workers=2),
        DataLoader(theirs, batch_size=3, collate_fn=collate),
        strict=True,
    ):
        assert_same(a, b)


@pytest.mark.parametrize("schema", ["specforge-dflash", "specforge-eagle3"])
def test_specforge_loader_from_the_output_equals_its_loader_on_the_export(schema, output, tmp_path):
    needs("specforge")
    from specforge.algorithms.common import dflash_family_data as dflash
    from specforge.algorithms.eagle3 import data as eagle3
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    from hsextract.training.specforge import OutputFeatureStore, OutputManifestReader

    if schema == "specforge-dflash":
        strategy, own_reader = (
            "dflash",
            lambda path: dflash.build_offline_reader(
                "dflash", path, run_id="offline", ttt_length=7, max_len=4096
            ),
        )
        normalize, collate = dflash.build_offline_normalizer(4096), dflash.build_collator()
    else:
        strategy, own_reader = (
            "eagle3",
            lambda path: eagle3.build_offline_reader(path, run_id="offline", ttt_length=7, max_len=4096),
        )
        normalize, collate = eagle3.build_offline_normalizer(4096), eagle3.build_offline_collator()

    def by_sample(store, refs, sample_of):
        loader = FeatureDataLoader(
            store,
            refs=refs,
            batch_size=1,
            collate_fn=collate,
            per_sample_transform=normalize,
            drop_last=False,
            strategy=strategy,
            num_workers=2,
        )
        return {sample_of[b.sample_ids[0]]: b.tensors for b in loader}

    dest = exported(output, tmp_path, schema)
    order = manifest_order(output)
    refs = own_reader(str(dest)).read()
    index_of = {r.sample_id: int(Path(r.feature_store_uri).name[5:-5]) for r in refs}  # data_I.ckpt
    theirs = by_sample(LocalFeatureStore("export"), refs, {k: order[i] for k, i in index_of.items()})

    store = OutputFeatureStore(output, schema)
    refs = OutputManifestReader(store, strategy=strategy, max_len=4096).read()
    ours = by_sample(store, refs, {r.sample_id: store.data.sample_ids[i] for i, r in enumerate(refs)})
    assert ours.keys() == theirs.keys() and len(ours) == len(store.data)
    if schema == "specforge-dflash":  # the samples SpecForge's DFlash loader raises on are left out by both
        assert set(order) - set(ours) == set(store.data.index.skipped)
    for sid in ours:
        assert_same(ours[sid], theirs[sid], sid)


def test_modelopt_batches_from_the_output_equal_those_from_its_export(output, tmp_path):
    needs("modelopt.torch.speculative.eagle.utils")
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    from hsextract.training.modelopt import OfflineOutputDataset

    dest = exported(output, tmp_path, "modelopt")
    files = sorted(str(p) for p in (dest / "conversations").rglob("*.pt"))
    by_id = {torch.load(f, weights_only=True)["conversation_id"]: f for f in files}
    collate = EagleOfflineDataCollator(train_len=128)
    for answer_only_loss in (True, False):
        ours = OfflineOutputDataset(output, answer_only_loss=answer_only_loss)
        theirs = OfflineSupervisedDataset(
            [by_id[sid] for sid in ours.sample_ids], answer_only_loss=answer_only_loss
        )
        assert len(ours) == len(theirs) == len(files)
        for i in range(len(ours)):
            assert_same(ours[i], theirs[i], f"sample {i}")
        for a, b in zip(
            DataLoader(ours, batch_size=4, collate_fn=collate, num_workers=2),
            DataLoader(theirs, batch_size=4, collate_fn=collate),
            strict=True,
        ):
            assert_same(a, b)


def test_a_speculators_eagle3_drafter_trains_from_the_output(output, tiny_lm):
    """speculators' own draft model, loss and collator on CPU (eager loss and attention), fed by StatesDataset; the
    verifier-owned weights come from the tiny target, its final norm as speculators' norm (Qwen3.5: 1 + weight)."""
    needs("speculators.models.eagle3.core")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.data import CollateFn
    from transformers import LlamaConfig

    manifest = json.loads((output / "manifest.json").read_text())
    vocab, hidden = manifest["vocab_size"], manifest["hidden_size"]
    layer = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        num_hidden_layers=1,
        max_position_embeddings=4096,
        rms_norm_eps=tiny_lm.config.rms_norm_eps,
    )
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=vocab,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[k + 1 for k in manifest["layer_ids"]],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=2)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tiny_lm.get_input_embeddings().weight)
        model.lm_head.weight.copy_(tiny_lm.lm_head.weight)
        model.verifier_lm_head.weight.copy_(tiny_lm.lm_head.weight)
        model.verifier_norm.weight.copy_(1 + tiny_lm.model.norm.weight)
    call, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=2, ttt_step_loss_decay=1.0
    )
    data = StatesDataset(output, "speculators", seed=0, dtype=torch.float32)
    collate = CollateFn(max_len=256, hidden_size=hidden, num_target_layers=3, dtype=torch.float32)
    batches = list(DataLoader(data, batch_size=4, collate_fn=collate, num_workers=2))[:2]
    # The target speculators distils from is the target model's own normed final state.
    final = StatesMapDataset(output, "raw", dtype=torch.float32)[data.rank_sequence()[0]][
        "final_hidden_state"
    ]
    n = min(final.shape[0], 256)  # the collator packs samples into one row of max_len tokens
    torch.testing.assert_close(
        model.verifier_norm(batches[0]["verifier_last_hidden_states"][0, :n]), final[:n], rtol=1e-4, atol=1e-4
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(10):
        batch = {k: v for k, v in batches[step % 2].items() if isinstance(v, torch.Tensor)}
        _, loss, _ = model(**batch, **call)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses
