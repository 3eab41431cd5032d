"""GPU-only behaviour: hooks on the real architecture with flash-linear-attention kernels, pinned async copies and
several worker processes on one GPU. Skipped without CUDA; run on the GPU machine (scripts/gpu_session.sh)."""

import json

import pytest
import torch
from support.cli import TINY_LIMITS, cli_run_args, run_cli, write_mixed_dataset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _implementations(fn, seen=None):
    """Every function reachable from ``fn`` through wrappers and closures."""
    seen = set() if seen is None else seen
    if id(fn) in seen or not callable(fn):
        return seen
    seen.add(id(fn))
    yield fn
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            yield from _implementations(cell.cell_contents, seen)
        except ValueError:
            pass
    if hasattr(fn, "__wrapped__"):
        yield from _implementations(fn.__wrapped__, seen)


@pytest.fixture(scope="module")
def real_shape_lm():
    """The Qwen3.6-27B layer shapes (hidden 5120, 48 value heads, head_dim 256), 8 layers, random bf16 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained("configs/qwen3.6-27b")
    cfg.num_hidden_layers = 8
    cfg.layer_types = cfg.layer_types[:8]
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return lm.eval()


def test_fla_kernels_are_used():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    entry = (
        getattr(m, "chunk_gated_delta_rule", None) or m.torch_chunk_gated_delta_rule
    )  # the dispatching wrapper
    modules = {getattr(f, "__module__", "") or "" for f in _implementations(entry)}
    assert any(mod.startswith("fla") for mod in modules), f"transformers does not dispatch to FLA: {modules}"


def test_hooks_on_real_architecture_match_hf_in_bf16(real_shape_lm):
    from hsextract.model.capture import GatherTarget, LayerCapture

    lm = real_shape_lm
    lengths = [700, 1, 64, 333, 5, 128]
    seqs = [torch.randint(0, 240000, (n,), device="cuda") for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    flat = torch.cat([torch.arange(r * width, r * width + n, device="cuda") for r, n in enumerate(lengths)])
    layer_ids = (1, 3, 6)
    out = torch.full((len(flat), 3, 5120), float("nan"), dtype=torch.bfloat16, device="cuda")
    with LayerCapture(lm, layer_ids) as cap, torch.inference_mode():
        cap.forward(ids, mask, GatherTarget(flat, out))
    off, worst = 0, 0.0
    for s in seqs:
        with torch.inference_mode():
            ref = lm(s[None], output_hidden_states=True).hidden_states
        for j, k in enumerate(layer_ids):
            got, want = out[off : off + len(s), j].float(), ref[k + 1][0].float()
            rel = ((got - want).norm() / want.norm()).item()
            worst = max(worst, rel)
            assert rel < 2e-2, (k, len(s), rel)
            nbr = ((got - ref[k][0].float()).norm() / want.norm()).item()
            assert nbr > 5 * rel, (k, len(s), rel, nbr)
        off += len(s)
    print(f"worst relative error vs HF (bf16, FLA): {worst:.2e}")


def test_cli_run_two_shards_on_one_gpu_matches_hf(tmp_path, tiny_model, tiny_tokenizer):
    from hsextract.model.load import load_model
    from hsextract.output import open_output

    data = write_mixed_dataset(tmp_path / "data.jsonl", tiny_tokenizer)
    args = cli_run_args(
        tmp_path,
        tiny_model,
        data,
        staging=None,  # the default, /dev/shm
        layers="0,3,6",
        device="cuda",
        gpus="0,0",
        shards=2,
        **TINY_LIMITS,
        num_proc=2,
        no_progress=True,
    )
    r = run_cli(*args, timeout=900)
    print(r.stdout)
    lm = load_model(str(tiny_model), dtype="float32", device="cuda")
    out = open_output(tmp_path / "out")
    assert len(out) == sum(1 for _ in open(data))
    for sample in out:
        with torch.inference_mode():
            ref = lm(sample["input_ids"].cuda()[None], output_hidden_states=True).hidden_states
        for k in (0, 3, 6):
            torch.testing.assert_close(sample["layers"][k], ref[k + 1][0].cpu(), rtol=1e-2, atol=1e-2)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("shard-*.log"))
    assert "model loaded" in logs
    json.loads((tmp_path / "out" / "manifest.json").read_text())


def test_fp8_pipeline_on_the_gpu_copies_values_and_scales_through_pinned_buffers(real_shape_lm):
    """The Extractor's fp8 path on CUDA (quantized in the hooks, values and scales copied on the side stream) gives
    exactly the quantization of the unquantized capture, with the final state as the last slot."""
    import numpy as np

    from hsextract.output import StateLayout
    from hsextract.output.fp8 import quantize_fp8
    from hsextract.prepare.plan import make_plan
    from hsextract.prepare.tokenfile import TokenizedSamples
    from hsextract.run.pipeline import Extractor

    lm = real_shape_lm
    rng = np.random.default_rng(0)
    lengths = [700, 1, 64, 333, 5, 128, 900, 17]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, 240000, offsets[-1], dtype=np.int32)
    samples = TokenizedSamples(
        sample_ids=[str(i) for i in range(len(lengths))],
        input_ids=ids,
        loss_mask=np.ones_like(ids, dtype=np.uint8),
        offsets=offsets,
    )
    plan = make_plan(lengths, max_tokens_per_batch=2048, max_rows=16, shards=1)
    slots = StateLayout((1, 3), 8, final_state=True).slot_layers  # (1, 3, 7)
    device = torch.device("cuda", 0)

    def capture(storage):
        got = {}
        ext = Extractor(
            lm, slots, device=device, max_tokens=2048, num_slots=2, pad_token_id=0, storage_dtype=storage
        )
        ext.run(
            plan.batches, samples, lambda b, t: got.update({b.batch_id: {k: v.clone() for k, v in t.items()}})
        )
        return got

    runs = {storage: capture(storage) for storage in (None, "float8_e4m3fn")}
    assert len(runs[None]) == len(plan.batches) > 1
    for batch_id, plain in runs[None].items():
        fp8 = runs["float8_e4m3fn"][batch_id]
        q, s = quantize_fp8(plain["hidden_states"].cuda())
        assert fp8["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(fp8["hidden_states"].view(torch.uint8), q.cpu().view(torch.uint8))
        assert torch.equal(fp8["hidden_states_scale"], s.cpu())


def test_host_buffers_made_ahead_are_pinned_exact_size_and_taken_by_size():
    """startup/hostmem.py: buffers reserved in the background are page-locked (an async device-to-host copy into them
    lands the device's values), of the size asked (no power-of-two rounding), taken smallest-that-fits, and a
    request no reserved buffer fits gets a new pinned one."""
    from hsextract.startup import hostmem

    mb = 1 << 20
    hostmem.reserve(2, 3 * mb + 5)
    assert hostmem.reserved()[0] == 2
    small = hostmem.host_buffer(
        (1 * mb) // 2, torch.bfloat16
    )  # 1 MiB: the smallest that fits is a reserved one
    assert hostmem.reserved()[0] == 1
    big = hostmem.host_buffer(2 * mb, torch.bfloat16)  # 4 MiB: none fits, so a new one
    assert hostmem.reserved()[0] == 1
    hostmem.drop_reserved()
    assert hostmem.reserved()[0] == 0
    for buf, numel in ((small, mb // 2), (big, 2 * mb)):
        assert buf.is_pinned() and buf.numel() == numel and buf.dtype == torch.bfloat16
        owner = buf._hsextract_pinned
        assert owner.numel() in (
            3 * mb + 5,
            4 * mb,
        )  # exact: the caching allocator would give 4 MiB and 4 MiB
        src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            buf.copy_(src, non_blocking=True)
        stream.synchronize()
        assert torch.equal(buf, src.cpu())


TUNED_PROBE = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from hsextract.model import qwen3_5 as kernels
from hsextract.startup.warmup import fla_patch, tables as tuned
from hsextract.startup.warmup.fla_patch import pin_token_count_autotune
cfg = AutoConfig.from_pretrained("configs/qwen3.6-27b").get_text_config()
cfg.num_hidden_layers = 4
cfg.layer_types = cfg.layer_types[:4]
torch.manual_seed(0)
with torch.device("cuda"):
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
kernels.apply(lm, "fused")
pin_token_count_autotune()
answered = tuned.install_here()
ids = torch.randint(0, cfg.vocab_size, (4, 3000), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
mask = torch.ones_like(ids)
mask[1:, 1500:] = 0  # right-padded rows, as a run's batches (and the warm-up's) are: the kernels a run calls
with torch.inference_mode():
    hs = lm.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
valid = mask.bool()
torch.save([h[valid].float().cpu() for h in hs], sys.argv[1])
timed = [k for k, t in tuned.autotuners() if getattr(t, "configs_timings", None)]
answered_ids = [k for k, t in tuned.autotuners() if fla_patch.is_answered(t)]
print(json.dumps({"answered": answered, "timed": timed, "answered_ids": answered_ids}))
"""


def test_the_shipped_autotune_table_answers_the_real_shapes_without_timing_and_gives_the_timed_states(
    tmp_path,
):
    """A fresh process on Qwen3.6-27B's layer shapes answers FLA's autotuners from the table shipped for this GPU
    (startup/warmup/tables.py): none of them times its candidates, and the states equal, to bf16 rounding, those of a
    process that timed every candidate itself (HSEXTRACT_TUNED=0)."""
    import os
    import subprocess
    import sys

    from hsextract.startup.warmup import tables as tuned

    if not (tuned.SHIPPED_DIR / tuned.gpu_file_name(torch.cuda.get_device_name())).is_file():
        pytest.skip(f"no autotune table is shipped for {torch.cuda.get_device_name()}")
    runs = {}
    for name, extra in (("tuned", {}), ("timed", {tuned.TUNED_ENV: "0"})):
        r = subprocess.run(
            [sys.executable, "-c", TUNED_PROBE, str(tmp_path / f"{name}.pt")],
            capture_output=True,
            text=True,
            timeout=400,
            env={**os.environ, **extra},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs["tuned"]["answered"] >= 6, runs["tuned"]
    assert not set(runs["tuned"]["timed"]) & set(runs["tuned"]["answered_ids"]), runs["tuned"]
    assert runs["timed"]["answered"] == 0 and runs["timed"]["timed"], runs["timed"]
    a, b = torch.load(tmp_path / "tuned.pt"), torch.load(tmp_path / "timed.pt")
    for layer, (x, y) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(
            x, y, rtol=2e-2, atol=2e-2, msg=lambda m, layer=layer: f"layer {layer}: {m}"
        )
