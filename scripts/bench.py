"""GPU benchmark: hsextract's worker loop against the forward floor and a naive blocking loop, in one process.

    python scripts/bench.py --config configs/qwen3.6-27b --tokens 400000

Builds the architecture from a config with random bf16 weights (no download), makes length-sorted batches of a
realistic length mix (median 221, mean ~330, p99 ~1800 tokens), and times on the same batches:

  (a) forward of the needed layers only (early exit after the deepest id, no capture): the floor;
  (b) hsextract's Extractor end to end: hooks, on-device gather, async copy into pinned buffers on a side stream,
      writer thread saving safetensors files to /dev/shm (each file removed after it is written, as the uploader
      would);
  (c) a naive loop: hooks, GPU concat, one blocking ``.cpu()`` per layer, synchronous ``safetensors.save_file``;
  (a') and (b'): (a) and (b) with hsextract.model.qwen3_5's fused kernels swapped in (modes ``af`` and ``bf``);
  (b8) and (b8'): (b) and (b') storing fp8 (``--storage-dtype float8_e4m3fn``): the capture hooks quantize each
      token's vector on the GPU (scale per token per layer) before the copy to the host.

``--final-state`` adds the last layer's output as one more slot, as ``run --final-state`` does: every mode then
runs the forward to the last layer (the floor (a) too, so the ratios compare like with like).

Prints tokens/s on real and on padded (computed) tokens, the ratios, and model TFLOP/s (2 x parameters of layers
0..deepest per computed token). ``--startup`` also measures time to the first batch in fresh processes with an
empty and a warm Triton cache, stock and fused.

``--kernel-profile`` instead times each swapped module alone, stock against fused, on a few layers of the real
shape and one padded batch (inputs captured from a stock forward), then the whole shallow forward, with a
profiler breakdown of CUDA time by kernel family for both: the measurements that pick what to fuse next.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hsextract.format.batch import StateLayout  # noqa: E402
from hsextract.layers import resolve_layer_ids  # noqa: E402
from hsextract.model import qwen3_5 as kernels
from hsextract.model.capture import LayerCapture, _StopForward
from hsextract.model.load import decoder_layers, load_model
from hsextract.prepare.plan import make_plan  # noqa: E402
from hsextract.prepare.tokenfile import TokenizedSamples  # noqa: E402
from hsextract.run.pipeline import Extractor, build_batch  # noqa: E402
from hsextract.run.writer import write_batch_file  # noqa: E402


def realistic_samples(total_tokens: int, vocab: int, max_length: int, seed: int = 0) -> TokenizedSamples:
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total_tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(221), 0.9), 1, max_length)))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(0, vocab, offsets[-1], dtype=np.int32)
    return TokenizedSamples(
        sample_ids=[str(i) for i in range(len(lengths))],
        input_ids=ids,
        loss_mask=np.ones_like(ids, dtype=np.uint8),
        offsets=offsets,
    )


def sync():
    torch.cuda.synchronize()


def bench_forward_only(lm, layer_ids, batches, samples, device, pad):
    deepest = max(layer_ids)
    layers = decoder_layers(lm)

    def stop(*_):
        raise _StopForward

    h = layers[deepest].register_forward_hook(stop)
    decoder = LayerCapture(lm, layer_ids).decoder
    try:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in batches:
                x = build_batch(samples, b, pad)
                try:
                    decoder(
                        input_ids=x.input_ids.to(device, non_blocking=True),
                        attention_mask=x.attention_mask.to(device, non_blocking=True),
                        use_cache=False,
                    )
                except _StopForward:
                    pass
        sync()
        return time.perf_counter() - t0
    finally:
        h.remove()


def bench_hsextract(
    lm, layer_ids, batches, samples, device, pad, staging: Path, slots: int, storage_dtype=None
):
    ext = Extractor(
        lm,
        layer_ids,
        device=device,
        max_tokens=max(b.num_tokens for b in batches),
        num_slots=slots,
        pad_token_id=pad,
        storage_dtype=storage_dtype,
    )
    written = []

    def on_batch(b, tensors):
        path = staging / f"batch-{b.batch_id:06d}.safetensors"
        written.append(write_batch_file(path, tensors, {"batch_id": str(b.batch_id)})[0])
        path.unlink()

    sync()
    t0 = time.perf_counter()
    ext.run(batches, samples, on_batch)
    sync()
    dt = time.perf_counter() - t0
    del ext
    torch.cuda.empty_cache()
    return dt, sum(written)


def bench_naive(lm, layer_ids, batches, samples, device, pad, staging: Path):
    from safetensors.torch import save_file

    layers = decoder_layers(lm)
    deepest = max(layer_ids)
    captured = {}

    def make(k):
        def hook(m, a, out):
            captured[k] = out[0] if isinstance(out, tuple) else out
            if k == deepest:
                raise _StopForward

        return hook

    handles = [layers[k].register_forward_hook(make(k)) for k in layer_ids]
    decoder = LayerCapture(lm, layer_ids).decoder
    try:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in batches:
                x = build_batch(samples, b, pad)
                mask = x.attention_mask.to(device).bool()
                try:
                    decoder(input_ids=x.input_ids.to(device), attention_mask=mask.long(), use_cache=False)
                except _StopForward:
                    pass
                tensors = {f"layer_{k}": captured[k][mask].cpu() for k in layer_ids}  # blocks per layer
                tensors["input_ids"] = x.tokens_ids
                path = staging / f"naive-{b.batch_id:06d}.safetensors"
                save_file(tensors, str(path))
                path.unlink()
        sync()
        return time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------------------------------------------
# --kernel-profile: each swapped module alone, then the shallow forward with a profiler breakdown.

KERNEL_FAMILIES = [  # (family, regex on the CUDA kernel name), first match wins
    ("attention (sdpa)", r"sdpa|flash|fmha|attention|mha"),  # before conv: cuDNN's SDPA kernel says "fprop"
    ("causal conv", r"conv"),
    ("our q/k norm+rope, gate", r"qk_norm_rope|sigmoid_gate"),
    ("matrix products", r"gemm|cutlass|xmma|nvjet|cublas|s16816|wgmma"),
    ("FLA chunk kernels", r"chunk|delta|kkt|solve_tril|recompute_w_u|fwd_h|fwd_o|l2norm|beta_sigmoid"),
    ("norms", r"rms|norm"),
    ("silu * mul", r"swiglu|silu"),
    ("copies, casts, cat", r"copy|cpy|memset|cat|index|repeat|gather|scatter|fill"),
    ("other elementwise", r"elementwise|vectorized|unrolled|reduce"),
]


def kernel_breakdown(fn, steps: int = 3) -> tuple[dict, int]:
    """CUDA time per kernel family (ms per step) over ``steps`` calls of ``fn``, and kernels launched per step."""
    import re

    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    fams: dict = {}
    launches = 0
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t <= 0:
            continue
        launches += ev.count
        fam = next((f for f, rx in KERNEL_FAMILIES if re.search(rx, ev.key, re.I)), "other")
        fams.setdefault(fam, {"ms": 0.0, "top": []})
        fams[fam]["ms"] += t / 1000 / steps
        fams[fam]["top"].append((t / 1000 / steps, ev.key[:90]))
    for f in fams.values():
        f["top"] = sorted(f["top"], reverse=True)[:8]
    return fams, launches // steps


def cuda_time(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


class ClockSampler:
    """SM clock (MHz) and board power (W) read every 50 ms through NVML while a block runs: whether a denser
    stream of matrix products runs the GPU at lower clocks (power limit) shows here, without touching any setting."""

    def __init__(self):
        import threading

        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.05):
            try:
                self.samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
            except Exception:  # no NVML here: no samples
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks, watts = zip(*self.samples, strict=True)
        return {
            "sm_clock_mhz_mean": float(np.mean(clocks)),
            "power_w_mean": float(np.mean(watts)),
            "n": len(clocks),
        }


def _capture_module_inputs(decoder, modules: dict, ids, mask) -> dict:
    got = {}
    handles = [
        mod.register_forward_pre_hook(
            lambda m, a, kw, n=name: got.setdefault(n, (a, dict(kw))), with_kwargs=True
        )
        for name, mod in modules.items()
    ]
    try:
        with torch.inference_mode():
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


def kernel_profile(args) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    cfg = AutoConfig.from_pretrained(args.config).get_text_config()
    cfg.num_hidden_layers = args.profile_layers
    cfg.layer_types = cfg.layer_types[: args.profile_layers]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    decoder = LayerCapture(lm, (0,)).decoder
    layers = decoder_layers(lm)
    gdn_i = cfg.layer_types.index("linear_attention")
    att_i = cfg.layer_types.index("full_attention")
    gdn, att = layers[gdn_i], layers[att_i]
    rows, length = args.profile_rows, args.profile_length
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    lengths[0] = length
    ids = torch.randint(0, cfg.vocab_size, (rows, length), generator=g).cuda()
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long().cuda()
    real, padded = int(lengths.sum()), rows * length
    out: dict = {"layers": args.profile_layers, "rows": rows, "length": length, "real_tokens": real}
    print(f"kernel profile: {args.profile_layers} layers, {rows} x {length} tokens ({real} real)", flush=True)

    mods = {
        "input rms_norm": gdn.input_layernorm,
        "Gated-DeltaNet mixer": gdn.linear_attn,
        "gated rms_norm": gdn.linear_attn.norm,
        "attention mixer": att.self_attn,
        "MLP": gdn.mlp,
        "Gated-DeltaNet layer": gdn,
        "attention layer": att,
    }
    inputs = _capture_module_inputs(decoder, mods, ids, mask)
    x = inputs["Gated-DeltaNet mixer"][1]["hidden_states"]  # the normed layer input
    lin = gdn.linear_attn

    def unmasked(kw):
        return {k: (None if k == "attention_mask" else v) for k, v in kw.items()}

    def module_pair(name):
        mod = mods[name]
        a, kw = inputs[name]
        return (lambda: type(mod).forward(mod, *a, **kw)), (lambda: mod(*a, **unmasked(kw)))

    # Parts of the Gated-DeltaNet mixer, stock (as transformers runs them) against fused.
    with torch.inference_mode():
        qkv = lin.in_proj_qkv(x)
        b, a = lin.in_proj_b(x), lin.in_proj_a(x)
        w = lin.conv1d.weight.squeeze(1)
        kd = lin.key_dim
        q_, k_, v_ = torch.split(
            m.causal_conv1d_fn(qkv.transpose(1, 2), w, None, activation="silu").transpose(1, 2),
            [kd, kd, lin.value_dim],
            dim=-1,
        )
        B, T = x.shape[:2]
        q_, k_ = q_.reshape(B, T, -1, lin.head_k_dim), k_.reshape(B, T, -1, lin.head_k_dim)
        v_ = v_.reshape(B, T, -1, lin.head_v_dim)
    lib = kernels._libs()
    rep = lin.num_v_heads // lin.num_k_heads

    def conv_stock():
        y = m.causal_conv1d_fn(qkv.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
        q, k, v = torch.split(y, [kd, kd, lin.value_dim], dim=-1)
        return q.contiguous(), k.contiguous(), v.contiguous()  # FLA's input guard makes these copies

    def conv_fused():
        return [
            lib.causal_conv1d(qkv[..., s], w[s], activation="silu")[0]
            for s in (slice(0, kd), slice(kd, 2 * kd), slice(2 * kd, None))
        ]

    def rule_stock():
        beta = b.sigmoid()
        gg = -lin.A_log.float().exp() * torch.nn.functional.softplus(a.float() + lin.dt_bias)
        return m.torch_chunk_gated_delta_rule(
            q_.repeat_interleave(rep, 2),
            k_.repeat_interleave(rep, 2),
            v_,
            g=gg,
            beta=beta,
            use_qk_l2norm_in_kernel=True,
        )

    def rule_fused():
        return lib.chunk_gated_delta_rule(
            q_,
            k_,
            v_,
            g=a,
            beta=b,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=lin.A_log,
            dt_bias=lin.dt_bias,
            use_beta_sigmoid_in_kernel=True,
        )

    mlp = gdn.mlp
    h_mlp = inputs["MLP"][0][0]
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    resid = inputs["Gated-DeltaNet layer"][0][0]
    post = gdn.post_attention_layernorm

    def add_norm_stock():
        s = resid + x
        return type(post).forward(post, s)

    pairs = {
        "input rms_norm": module_pair("input rms_norm"),
        "causal conv1d + silu (q, k, v)": (conv_stock, conv_fused),
        "gated delta rule (repeat q/k vs GVA)": (rule_stock, rule_fused),
        "gated rms_norm": module_pair("gated rms_norm"),
        "Gated-DeltaNet mixer": module_pair("Gated-DeltaNet mixer"),
        "attention mixer": module_pair("attention mixer"),
        "residual add + rms_norm": (add_norm_stock, lambda: kernels.add_rms_norm(x, resid, post)),
        "MLP": module_pair("MLP"),
        "MLP, gate/up one GEMM": (
            module_pair("MLP")[0],
            lambda: mlp.down_proj(LigerFusedGateUpSiLUMulFunction.apply(h_mlp @ gate_up.t())),
        ),
        "Gated-DeltaNet layer": module_pair("Gated-DeltaNet layer"),
        "attention layer": module_pair("attention layer"),
    }
    # Stock timings with transformers' forwards everywhere (a stock layer calls its mixer), then fused.
    times: dict = {}
    with torch.inference_mode():
        for mode in ("stock", "fused"):
            kernels.apply(lm, mode)
            for name, pair in pairs.items():
                times.setdefault(name, {})[mode] = cuda_time(pair[mode == "fused"])
        kernels.restore(lm)
    rows_out = []
    for name, t in times.items():
        rows_out.append({"module": name, "stock_ms": t["stock"], "fused_ms": t["fused"]})
        print(
            f"  {name:40s} stock {t['stock']:8.2f} ms  fused {t['fused']:8.2f} ms  {t['stock'] / t['fused']:5.2f}x"
        )
    out["modules"] = rows_out

    def forward():
        decoder(input_ids=ids, attention_mask=mask, use_cache=False)

    whole = {}
    with torch.inference_mode():
        for mode in ("stock", "fused"):
            kernels.apply(lm, mode)
            with ClockSampler() as clocks:
                ms = cuda_time(forward, reps=5)
            fams, launches = kernel_breakdown(forward)
            whole[mode] = {
                "ms": ms,
                "clocks": clocks.summary(),
                "padded_tokens_per_s": padded / ms * 1e3,
                "real_tokens_per_s": real / ms * 1e3,
                "kernels_per_forward": launches,
                "families": fams,
            }
        kernels.restore(lm)
    out["forward"] = whole
    lines = [
        "",
        f"| {args.profile_layers}-layer forward, {rows} x {length} | stock | fused |",
        "|---|---|---|",
        f"| ms per forward | {whole['stock']['ms']:.1f} | {whole['fused']['ms']:.1f} "
        f"({whole['stock']['ms'] / whole['fused']['ms']:.3f}x) |",
        f"| kernels launched per forward | {whole['stock']['kernels_per_forward']} | "
        f"{whole['fused']['kernels_per_forward']} |",
        "| mean SM clock, board power while timed | "
        + " | ".join(
            f"{c.get('sm_clock_mhz_mean', float('nan')):.0f} MHz, {c.get('power_w_mean', float('nan')):.0f} W"
            for c in (whole["stock"]["clocks"], whole["fused"]["clocks"])
        )
        + " |",
    ]
    fams = sorted(
        {f for w in whole.values() for f in w["families"]},
        key=lambda f: -whole["stock"]["families"].get(f, {}).get("ms", 0),
    )
    for f in fams:
        cells = []
        for mode in ("stock", "fused"):
            t = whole[mode]["families"].get(f, {}).get("ms", 0.0)
            tot = sum(v["ms"] for v in whole[mode]["families"].values())
            cells.append(f"{t:.1f} ms ({100 * t / tot:.1f}%)")
        lines.append(f"| {f} | {cells[0]} | {cells[1]} |")
    print("\n".join(lines), flush=True)
    for mode in ("stock", "fused"):
        print(f"top kernels, {mode}:")
        for f, v in sorted(whole[mode]["families"].items(), key=lambda kv: -kv[1]["ms"]):
            for t, name in v["top"][:3]:
                print(f"  {t:8.2f} ms  [{f}] {name}")
    return out


def startup_probe(args) -> None:
    """Child mode: build a shallow model of the config's shape, time the first batches (Triton compiles here)."""
    t_entry = time.perf_counter()
    times = {"python_and_imports_s": time.time() - float(os.environ.get("HSX_SPAWN_T", time.time()))}
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401  (imports flash-linear-attention)

    times["transformers_and_fla_import_s"] = time.perf_counter() - t_entry
    t0 = time.perf_counter()
    lm = load_model(str(Path(args.startup_model)), dtype="bfloat16", device="cuda", random_weights=True)
    sync()
    times["model_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    times["kernels"] = kernels.apply(lm, args.kernels)
    times["apply_kernels_s"] = time.perf_counter() - t0
    samples = realistic_samples(200_000, lm.config.vocab_size, args.max_length, seed=1)
    plan = make_plan(
        samples.lengths.tolist(), max_tokens_per_batch=args.max_tokens, max_rows=args.max_rows, shards=1
    )
    ids = tuple(range(lm.config.num_hidden_layers))
    batches = list(plan.batches)[: args.startup_batches]
    ext = Extractor(
        lm,
        ids,
        device=torch.device("cuda", 0),
        max_tokens=max(b.num_tokens for b in batches),
        num_slots=2,
        pad_token_id=0,
    )
    per_batch = []
    for b in batches:  # each a new shape: what the first batches of a run meet
        t0 = time.perf_counter()
        ext.run([b], samples, lambda b, t: None)
        sync()
        per_batch.append(round(time.perf_counter() - t0, 3))
    t0 = time.perf_counter()
    ext.run(batches, samples, lambda b, t: None)  # the same shapes again: the steady state
    sync()
    times.update(
        first_batch_s=per_batch[0],
        per_new_shape_batch_s=per_batch,
        same_batches_again_s=round(time.perf_counter() - t0, 3),
        shapes=[[b.rows, b.padded_length] for b in batches],
    )
    print(json.dumps(times))


def _autotune_report(stdout: str) -> dict:
    """Triton's TRITON_PRINT_AUTOTUNING lines: benchmarking seconds per kernel (cache misses only)."""
    import re

    found: dict = {}
    for fn, secs in re.findall(r"autotuning for function (\S+?),.*?finished after ([0-9.]+)s", stdout, re.S):
        found[fn] = round(found.get(fn, 0.0) + float(secs), 2)
    return {"seconds_total": round(sum(found.values()), 2), "runs": len(found), "per_kernel_s": found}


def measure_startup(args) -> dict:
    """Fresh processes, stock and fused: an empty Triton cache (cold) then the same cache again (warm). With
    ``--startup-cache DIR`` only the warm case, in that (already filled) cache."""
    shallow = Path(tempfile.mkdtemp()) / "shallow"
    shallow.mkdir()
    cfg = json.loads((Path(args.config) / "config.json").read_text())
    cfg["num_hidden_layers"] = (
        4  # 3 Gated-DeltaNet + 1 full attention: every kernel, a fraction of the weights
    )
    (shallow / "config.json").write_text(json.dumps(cfg))
    out = {}
    for mode in args.startup_kernels.split(","):
        cache = Path(args.startup_cache) if args.startup_cache else Path(tempfile.mkdtemp(prefix="triton-"))
        for label in ("warm_cache",) if args.startup_cache else ("cold_cache", "warm_cache"):
            env = dict(
                os.environ,
                TRITON_CACHE_DIR=str(cache),
                TRITON_PRINT_AUTOTUNING="1",
                HSX_SPAWN_T=str(time.time()),
            )
            t0 = time.perf_counter()
            r = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--startup-model",
                    str(shallow),
                    "--startup-batches",
                    str(args.startup_batches),
                    "--max-tokens",
                    str(args.max_tokens),
                    "--kernels",
                    mode,
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - t0
            key = f"{mode}_{label}"
            if r.returncode != 0:
                out[key] = {"error": r.stderr[-2000:]}
                continue
            out[key] = {
                "process_wall_s": round(wall, 2),
                **json.loads(r.stdout.strip().splitlines()[-1]),
                "autotuning": _autotune_report(r.stdout),
            }
            print(key, json.dumps(out[key]), flush=True)
        if not args.startup_cache:
            shutil.rmtree(cache, ignore_errors=True)
    return out


def model_and_batches(args, final_state: bool, device: str = "cuda"):
    """The target built from ``args.config`` with random bf16 weights, the layers a run stores (``args.layers``;
    the last one too with ``final_state``), the parameters of layers 0..deepest, and the realistic samples'
    length-sorted plan (``args.tokens``, ``args.max_tokens``, ``args.max_rows``, ``args.max_length``)."""
    import types

    t0 = time.perf_counter()
    lm = load_model(args.config, dtype="bfloat16", device=device, random_weights=True)
    build_s = time.perf_counter() - t0
    num_layers = lm.config.num_hidden_layers
    # The slots a run stores: the captured ids and, with the final state, the last layer.
    layer_ids = StateLayout(resolve_layer_ids(args.layers, num_layers), num_layers, final_state).slot_layers
    params = sum(p.numel() for p in decoder_layers(lm)[: max(layer_ids) + 1].parameters())
    samples = realistic_samples(args.tokens, lm.config.vocab_size, args.max_length)
    plan = make_plan(
        samples.lengths.tolist(), max_tokens_per_batch=args.max_tokens, max_rows=args.max_rows, shards=1
    )
    return types.SimpleNamespace(
        lm=lm, layer_ids=layer_ids, params=params, samples=samples, plan=plan, build_s=build_s
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3.6-27b")
    ap.add_argument("--layers", default="dflash")
    ap.add_argument("--tokens", type=int, default=400_000, help="tokens per timed pass")
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--max-rows", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--staging", default="/dev/shm/hsextract-bench")
    ap.add_argument(
        "--modes",
        default="a,b,c,af,bf",
        help="a, b, c stock; af, bf = (a'), (b') with fused kernels; b8, bf8 = (b), (b') storing fp8",
    )
    ap.add_argument(
        "--final-state", action="store_true", help="store the last layer's output too (run to it)"
    )
    ap.add_argument("--startup", action="store_true")
    ap.add_argument("--startup-kernels", default="stock,fused")
    ap.add_argument("--startup-cache", help="a filled Triton cache: measure only the warm start, in it")
    ap.add_argument("--startup-model")
    ap.add_argument("--startup-batches", type=int, default=12)
    ap.add_argument("--kernels", default="stock", help="startup probe child: stock or fused")
    ap.add_argument(
        "--kernel-profile", action="store_true", help="each swapped module alone, then the shallow forward"
    )
    ap.add_argument("--profile-layers", type=int, default=8)
    ap.add_argument("--profile-rows", type=int, default=64)
    ap.add_argument("--profile-length", type=int, default=1024)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.startup_model:
        return startup_probe(args)
    if args.kernel_profile:
        out = kernel_profile(args)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=1))
        return

    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import fla  # noqa: F401

        report["flash_linear_attention"] = getattr(fla, "__version__", "installed")
    except ImportError:
        report["flash_linear_attention"] = None
    if args.startup:
        report["startup"] = measure_startup(args)
        print(json.dumps(report["startup"], indent=1), flush=True)
    if args.modes == "none":
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=1))
        return

    setup = model_and_batches(args, args.final_state)
    lm, layer_ids, params, samples, plan = setup.lm, setup.layer_ids, setup.params, setup.samples, setup.plan
    report["model_build_s"] = setup.build_s
    device = torch.device("cuda", 0)
    batches = list(plan.batches)
    tokens = plan.num_tokens
    report.update(
        layer_ids=list(layer_ids), tokens=tokens, batches=len(batches), padding_waste=plan.padding_waste
    )
    print(
        f"{tokens} tokens in {len(batches)} batches, padding waste {100 * plan.padding_waste:.2f}%",
        flush=True,
    )

    padded_tokens = sum(b.padded_tokens for b in batches)

    def warm_up(label):
        """Every batch shape once, so Triton compilation and autotuning stay out of the timings."""
        t0 = time.perf_counter()
        bench_forward_only(lm, layer_ids, batches, samples, device, 0)
        report[f"warmup_{label}_s"] = time.perf_counter() - t0
        print(f"warm-up pass, {label} kernels: {report[f'warmup_{label}_s']:.1f} s", flush=True)

    staging = Path(args.staging)
    staging.mkdir(parents=True, exist_ok=True)
    results = {}
    warmed = set()
    for mode in args.modes.split(","):
        fused = mode in ("af", "bf", "bf8")
        report.setdefault("kernels", {})[mode] = kernels.apply(lm, "fused" if fused else "stock")
        if fused not in warmed:
            warm_up("fused" if fused else "stock")
            warmed.add(fused)
        if mode in ("a", "af"):
            dt = bench_forward_only(lm, layer_ids, batches, samples, device, 0)
        elif mode in ("b", "bf", "b8", "bf8"):
            fp8 = "float8_e4m3fn" if mode.endswith("8") else None
            dt, nbytes = bench_hsextract(lm, layer_ids, batches, samples, device, 0, staging, args.slots, fp8)
            report.setdefault("bytes_written", {})[mode] = nbytes
        elif mode == "c":
            dt = bench_naive(lm, layer_ids, batches, samples, device, 0, staging)
        results[mode] = {"s": dt, "tokens_per_s": tokens / dt, "padded_tokens_per_s": padded_tokens / dt}
        print(f"({mode}) {tokens / dt:,.0f} tokens/s  ({dt:.1f} s)", flush=True)
    kernels.restore(lm)
    report["tokens_per_s"] = {m: r["tokens_per_s"] for m, r in results.items()}
    report["results"] = results
    report["padded_tokens"] = padded_tokens
    flop_per_token = 2 * params
    report["flop_per_token"] = flop_per_token
    names = {
        "a": "(a) forward of layers 0..deepest only, stock transformers",
        "b": "(b) hsextract worker loop, files to /dev/shm",
        "c": "(c) blocking .cpu() per layer + sync save_file",
        "af": "(a') forward of layers 0..deepest only, fused kernels",
        "bf": "(b') hsextract worker loop, fused kernels",
        "b8": "(b8) hsextract worker loop storing fp8 (quantized on the GPU)",
        "bf8": "(b8') hsextract worker loop storing fp8, fused kernels",
    }
    lines = [
        "",
        "| loop | tokens/s (real) | tokens/s (padded, computed) | vs (a) | model TFLOP/s (computed) |",
        "|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        ratio = r["tokens_per_s"] / results["a"]["tokens_per_s"] if "a" in results else float("nan")
        lines.append(
            f"| {names[mode]} | {r['tokens_per_s']:,.0f} | {r['padded_tokens_per_s']:,.0f} | {ratio:.3f} | "
            f"{r['padded_tokens_per_s'] * flop_per_token / 1e12:,.0f} |"
        )
    tps = report["tokens_per_s"]
    ratios = [("b", "a"), ("b", "c"), ("af", "a"), ("bf", "af"), ("bf", "b"), ("b8", "a"), ("b8", "b")]
    ratios += [("bf8", "af"), ("bf8", "bf")]
    lines.append(
        "\n" + "   ".join(f"({x})/({y}) = {tps[x] / tps[y]:.3f}" for x, y in ratios if x in tps and y in tps)
    )
    lines[-1] = lines[-1].replace("(af)", "(a')").replace("(bf8)", "(b8')").replace("(bf)", "(b')")
    print("\n".join(lines), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
