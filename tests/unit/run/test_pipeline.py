"""The per-batch state check of the pipeline: counts per stored layer, the refusal naming batch and layer."""

import pytest
import torch

from hsextract.output import BatchSpec
from hsextract.output.fp8 import quantize_fp8
from hsextract.run.pipeline import BadStatesError, refuse_bad_states, state_health


def states_with_damage() -> torch.Tensor:
    x = torch.randn(6, 3, 16)
    x[2, 1, 5] = float("nan")
    x[4, 1, 0] = float("inf")
    x[3, 2] = 0.0
    return x


@pytest.mark.parametrize("fp8", [False, True])
def test_state_health_counts_non_finite_and_all_zero_tokens_per_layer(fp8):
    x = states_with_damage()
    if fp8:
        q, scale = quantize_fp8(x)
        health = state_health(q, scale)
    else:
        health = state_health(x.to(torch.bfloat16), None)
    assert health.tolist() == [[0, 2, 0], [0, 0, 1]]
    assert state_health(torch.randn(6, 3, 16), None).tolist() == [[0, 0, 0], [0, 0, 0]]


def test_bad_states_are_refused_naming_the_batch_and_the_first_bad_layer():
    batch = BatchSpec(batch_id=7, shard=1, sample_indices=(0, 1), num_tokens=6, padded_length=3)
    with pytest.raises(
        BadStatesError, match=r"batch 7 \(shard 1, .*\): layer 16 has 2 token\(s\) with NaN or Inf"
    ):
        refuse_bad_states(state_health(states_with_damage(), None), batch, (1, 16, 31), torch.float16)
    with pytest.raises(BadStatesError, match=r"layer 31 has 1 token\(s\) whose state is all zeros of 6"):
        x = states_with_damage()
        x[:, 1] = 1.0
        refuse_bad_states(state_health(x, None), batch, (1, 16, 31), torch.float16)
    refuse_bad_states(state_health(torch.ones(6, 3, 16), None), batch, (1, 16, 31), torch.float16)


def test_non_finite_target_topk_is_counted_and_refused_by_name():
    batch = BatchSpec(batch_id=7, shard=1, sample_indices=(0, 1), num_tokens=6, padded_length=3)
    logprobs = -torch.rand(6, 4)
    logprobs[5, 3] = float("nan")
    health = state_health(torch.ones(6, 3, 16), None, logprobs)
    assert health.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]
    with pytest.raises(
        BadStatesError, match=r"the target's top-k has 1 token\(s\) with NaN or Inf values of 6"
    ):
        refuse_bad_states(health, batch, (1, 16, 31), torch.bfloat16)


@pytest.mark.parametrize("storage", [None, "float8_e4m3fn"])
def test_the_early_workers_host_buffers_hold_the_pipelines_largest_batch(tiny_model, tmp_path, storage):
    """What an early worker pins while it imports (startup/early.py's slot_bytes, from the config and the model's
    config alone) is exactly a pipeline slot for the largest batch the config allows, so the pipeline takes it."""
    from hsextract.config import RunConfig
    from hsextract.model.load import load_model
    from hsextract.run.pipeline import Extractor
    from hsextract.run.preflight import check_inputs
    from hsextract.startup.early import pin_spec, slot_bytes

    cfg = RunConfig(
        model=str(tiny_model),
        data=str(tmp_path / "unused.jsonl"),
        output=str(tmp_path / "out"),
        run_dir=str(tmp_path / "run"),
        staging=str(tmp_path / "staging"),
        layers="1,2",
        final_state=True,
        storage_dtype=storage,
        dtype="bfloat16",
        device="cpu",
        max_tokens_per_batch=640,
        max_length=512,
    )
    facts = check_inputs(cfg)
    lm = load_model(str(tiny_model), dtype="bfloat16", device="cpu")
    ext = Extractor(
        lm,
        facts.layout.slot_layers,
        device=torch.device("cpu"),
        max_tokens=cfg.max_tokens_per_batch,
        num_slots=1,
        pad_token_id=0,
        storage_dtype=facts.layout.storage_dtype,
    )
    buf = ext.slots[0].device_buf
    assert slot_bytes(pin_spec(cfg), cfg.model) == buf.numel() * buf.element_size()


def test_a_stopped_pipeline_starts_no_further_batch(tiny_model):
    """The shard's stop (a signal, its uploader dead) ends the loop before the next forward, without a call back
    into the worker: nothing more reaches the writer."""
    import threading

    from hsextract.model.load import load_model
    from hsextract.run.pipeline import Extractor
    from hsextract.run.procs import Stopped

    lm = load_model(str(tiny_model), dtype="float32", device="cpu")
    ext = Extractor(lm, (1, 2), device=torch.device("cpu"), max_tokens=64, num_slots=1, pad_token_id=0)
    batch = BatchSpec(batch_id=0, shard=0, sample_indices=(0,), num_tokens=4, padded_length=4)
    stop, written = threading.Event(), []
    stop.set()
    with pytest.raises(Stopped):
        ext.run([batch], None, lambda b, t: written.append(b), stop=stop)
    assert written == []


def test_per_turn_batches_with_shared_prefixes_store_what_whole_rows_store(tiny_lm):
    """Two conversations' turn rows (3 and 6 turns) in one grouped plan: sharing prefixes computes each distinct
    token once (counted at the embedding) and stores the same states, fp8 scales and top-k as padded whole rows."""
    import numpy as np
    from support.turns import distinct_tokens, turn_rows

    from hsextract.prepare.plan import make_plan
    from hsextract.prepare.served import turn_groups
    from hsextract.prepare.tokenfile import TokenizedSamples
    from hsextract.run.pipeline import Extractor

    conversations = {"a": turn_rows(3, seed=3), "b": turn_rows(6, seed=6)}
    ids = [f"{c}#t{k + 1}" for c, rows in conversations.items() for k in range(len(rows))]
    rows = [r for rs in conversations.values() for r in rs]
    lengths = [len(r) for r in rows]
    samples = TokenizedSamples(
        sample_ids=ids,
        input_ids=np.concatenate(rows).astype(np.int32),
        loss_mask=np.ones(sum(lengths), dtype=np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
    )
    plan = make_plan(lengths, max_tokens_per_batch=4096, max_rows=64, shards=1, groups=turn_groups(ids))
    assert [b.sample_indices for b in plan.batches] == [tuple(range(len(rows)))]
    computed = []
    counter = tiny_lm.model.embed_tokens.register_forward_hook(lambda m, a, o: computed.append(a[0].numel()))
    try:
        stored = {}
        for share in (False, True):
            ext = Extractor(
                tiny_lm,
                (1, 3, 6),
                device=torch.device("cpu"),
                max_tokens=4096,
                num_slots=1,
                pad_token_id=0,
                storage_dtype="float8_e4m3fn",
                target_topk=4,
                share_prefixes=share,
            )
            computed.clear()
            ext.run(plan.batches, samples, lambda b, t, s=share: stored.setdefault(s, {**t}))
            stored[share] = {k: v.clone() for k, v in stored[share].items()}
    finally:
        counter.remove()
    distinct = sum(distinct_tokens(rs) for rs in conversations.values())
    assert sum(computed) == distinct < sum(lengths) / 1.9  # whole rows: the stored tokens and their padding
    whole, shared = stored[False], stored[True]
    assert whole.keys() == shared.keys()
    for key in ("input_ids", "loss_mask", "cu_seqlens", "sample_index"):
        assert torch.equal(whole[key], shared[key])
    scale_w, scale_s = whole["hidden_states_scale"], shared["hidden_states_scale"]
    torch.testing.assert_close(scale_s, scale_w, rtol=1e-4, atol=1e-6)
    states_w = whole["hidden_states"].float() * scale_w[..., None]
    states_s = shared["hidden_states"].float() * scale_s[..., None]
    # Float rounding apart, the same fp8 values: a value near a rounding edge may land one step (1/8) away.
    assert ((states_s - states_w).abs() <= states_w.abs() / 8 + 1e-6).all()
    codes_w, codes_s = (t["hidden_states"].view(torch.uint8) for t in (whole, shared))
    assert (codes_s != codes_w).float().mean() < 1e-3
    torch.testing.assert_close(
        shared["target_topk_logprobs"], whole["target_topk_logprobs"], rtol=1e-4, atol=1e-4
    )
