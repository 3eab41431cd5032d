"""The target's top-k (``--target-topk K``): the chunked computation against a direct one, the capture of a padded
batch against HF's unbatched logits, an output written in process (support/output.py) served by the reader and the
datasets, checked by verify, and its K part of the job's identity."""

import json

import pytest
import torch
from support.batch import padded
from support.cli import write_mixed_dataset
from support.compare import assert_topk_matches_hf
from support.damage import DAMAGED_ROW, copy_output, flip, manifest_batches, row_offset
from support.output import write_output

from hsextract.config import RunConfig
from hsextract.errors import CorruptOutputError, HsextractError
from hsextract.model.capture import GatherTarget, LayerCapture
from hsextract.model.target_topk import logits_chunk_tokens, target_topk_

K = 6


@pytest.mark.parametrize("chunk_tokens", [1, 7, 50, 64])
def test_chunked_topk_equals_the_direct_log_softmax_topk(chunk_tokens):
    torch.manual_seed(0)
    normed = torch.randn(50, 16)
    lm_head = torch.nn.Linear(16, 300, bias=False)
    ids = torch.full((50, K), -1, dtype=torch.int32)
    logprobs = torch.full((50, K), float("nan"))
    with torch.inference_mode():
        target_topk_(normed, lm_head, ids, logprobs, chunk_tokens=chunk_tokens)  # 7 leaves a chunk of 1
        want = lm_head(normed).log_softmax(-1).topk(K)
    torch.testing.assert_close(logprobs, want.values, atol=1e-5, rtol=0)
    assert torch.equal(ids.long(), want.indices)


def test_a_logits_chunk_holds_about_a_gigabyte_of_float32_logits():
    assert logits_chunk_tokens(248_320) == 1081
    assert logits_chunk_tokens(10**12) == 1


def test_padded_batch_topk_equals_hf_logits_of_each_sample_unbatched(tiny_lm):
    torch.manual_seed(3)
    seqs = [torch.randint(1, 500, (n,)) for n in (41, 1, 17, 9)]
    input_ids, mask, flat = padded(seqs)
    hidden = tiny_lm.config.hidden_size
    out = torch.full((len(flat), 1, hidden), float("nan"))
    ids = torch.full((len(flat), K), -1, dtype=torch.int32)
    logprobs = torch.full((len(flat), K), float("nan"))
    ran = []
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
        for i, layer in enumerate(tiny_lm.model.layers)
    ]
    try:
        with LayerCapture(tiny_lm, (1,), K) as cap, torch.inference_mode():
            cap.chunk_tokens = 5  # 68 tokens: chunks across sample boundaries, the last one short
            cap.forward(input_ids, mask, GatherTarget(flat, out, topk_ids=ids, topk_logprobs=logprobs))
    finally:
        for h in handles:
            h.remove()
    assert ran == list(range(len(tiny_lm.model.layers)))  # to the last layer, for the final state
    off = 0
    for s in seqs:
        with torch.inference_mode():
            ref = tiny_lm(s[None], output_hidden_states=True)
        rows = slice(off, off + len(s))
        assert_topk_matches_hf(ids[rows], logprobs[rows], ref.logits[0], where=f"{len(s)} tokens")
        torch.testing.assert_close(out[rows, 0], ref.hidden_states[2][0], rtol=1e-4, atol=1e-4)
        off += len(s)


@pytest.fixture(scope="module")
def topk_output(tmp_path_factory, tiny_model, tiny_tokenizer):
    root = tmp_path_factory.mktemp("topk")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer)
    return root, data, write_output(root, tiny_model, data, layers="1", target_topk=K)


def test_reader_and_datasets_serve_topk_equal_to_hf_on_supervised_tokens(topk_output, tiny_lm):
    from hsextract.output import open_output
    from hsextract.training import StatesDataset, StatesMapDataset

    _, _, out = topk_output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target_topk"] == K and manifest["fingerprint"]["target_topk"] == K
    output = open_output(out)
    assert output.target_topk == K
    checked = 0
    for s in list(output)[:12]:
        with torch.inference_mode():
            logits = tiny_lm(s["input_ids"][None]).logits[0]
        supervised = s["loss_mask"]
        assert_topk_matches_hf(
            s["target_topk_ids"][supervised],
            s["target_topk_logprobs"][supervised],
            logits[supervised],
            where=s["sample_id"],
        )
        checked += int(supervised.sum())
    assert checked > 100
    for item in (StatesMapDataset(out)[0], next(iter(StatesDataset(out, rank=0, world_size=1)))):
        read = output[item["sample_id"]]
        assert torch.equal(item["target_topk_ids"], read["target_topk_ids"])
        assert torch.equal(item["target_topk_logprobs"], read["target_topk_logprobs"])
        assert item["target_topk_ids"].shape == (len(item["input_ids"]), K)


def test_an_output_without_topk_is_as_before(written_output):
    from hsextract.container import read_file_head
    from hsextract.output import open_output

    manifest = json.loads((written_output / "manifest.json").read_text())
    assert "target_topk" not in manifest and "target_topk" not in manifest["fingerprint"]
    head = read_file_head(written_output / manifest["batches"][0]["key"])
    assert b"target_topk" not in head
    s = next(iter(open_output(written_output)))
    assert not any(key.startswith("target_topk") for key in s)


def test_verify_and_the_reader_catch_a_flipped_byte_in_the_topk(topk_output, tmp_path):
    from hsextract.output import open_output, verify_output

    out = copy_output(topk_output[2], tmp_path / "out")
    key = manifest_batches(out)[0]["key"]
    flip(out / key, row_offset(out / key, "target_topk_logprobs", DAMAGED_ROW) + 2, 0x01)
    report = verify_output(str(out), show_progress=False)
    assert [e.key for e in report.bad] == [key]
    assert "do not match their checksums" in report.bad[0].problem
    f = open_output(out).batch_file(key)
    with pytest.raises(CorruptOutputError, match="does not match its checksum"):
        open_output(out)[f.sample_ids[DAMAGED_ROW]]


def test_a_rerun_with_another_k_is_refused_naming_it(topk_output):
    from hsextract.run.preflight import prepare_run

    root, data, out = topk_output
    before = (out / "manifest.json").read_bytes()
    for k, says in ((K - 1, f"target_topk: {K} -> {K - 1}"), (None, f"target_topk: {K} -> None")):
        cfg = RunConfig(
            **{
                **RunConfig.load(root / "run" / "config.json").to_json(),
                "target_topk": k,
            }
        )
        with pytest.raises(HsextractError, match="holds a different plan") as e:
            prepare_run(cfg, echo=lambda *_: None, show_progress=False)
        assert says in str(e.value)
    assert (out / "manifest.json").read_bytes() == before


def test_a_bad_k_is_refused_before_the_model_loads(tiny_model, tmp_path):
    from hsextract.run.preflight import check_inputs

    fields = dict(
        model=str(tiny_model),
        data=str(tmp_path / "d.jsonl"),
        output=str(tmp_path / "o"),
        run_dir=str(tmp_path / "r"),
        staging=str(tmp_path / "s"),
        device="cpu",
    )
    with pytest.raises(HsextractError, match="--target-topk must be at least 1, got 0"):
        RunConfig(**fields, target_topk=0)
    with pytest.raises(HsextractError, match="--target-topk must be a whole number of tokens, got '8'"):
        RunConfig(**fields, target_topk="8")  # a quoted YAML value
    with pytest.raises(HsextractError, match="--target-topk 571 exceeds the model's vocabulary of 570"):
        check_inputs(RunConfig(**fields, target_topk=571))
