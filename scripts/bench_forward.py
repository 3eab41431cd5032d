"""The forward on a CUDA host: against the power-capped GEMM rate, inside the worker loop, by module, per new shape.

    python3 scripts/bench_forward.py variants --tokens 200000 --repeat 2 [--variants fused,stock,...] [--no-profile]
    python3 scripts/bench_forward.py loop --modes a,b,c,af,bf [--final-state] [--layers dflash,eagle3]
    python3 scripts/bench_forward.py modules [--profile-layers 8]
    python3 scripts/bench_forward.py shapes --model CKPT [--prewarm]
    python3 scripts/bench_forward.py pinning --slots 3 --gb 2.75

The target is built from ``--config`` with random bf16 weights (no download); batches are length-sorted, padded,
of the realistic mix (scripts/benchlib.py), at most ``--max-tokens`` tokens each.

``variants``: a bf16 GEMM of the MLP's shape run long enough to reach the power cap (the rate the forward is held
against), then each variant's forward of layers 0..deepest (early exit, no capture) after one untimed pass: real
and computed tokens/s, model TFLOP/s (2 x parameters per computed token), the fraction of the capped GEMM rate,
SM clock and power (NVML); then the first variant's CUDA time by kernel family and the ceilings it implies.
Variants: ``stock`` (transformers), ``fused`` (hsextract.model.qwen3_5 as a run uses it), ``fused-mlp-separate``
(gate and up as two GEMMs), ``fused-repeat-qk`` (q and k repeated to the value heads before FLA's chunked rule),
``fused-fp8`` (``--compute fp8``: the linears quantized by the served FP8 recipe, block-scaled GEMMs, the activations
quantized by their producing kernels; it drops the bf16 weights, so it runs last).

``loop``: on the same batches, (a) the forward alone (the floor), (b) hsextract's ``Extractor`` end to end (hooks,
on-device gather, pinned copies on a side stream, the writer thread's files to /dev/shm, each removed as the
uploader would), (c) a naive loop (blocking ``.cpu()`` per layer, synchronous ``save_file``); ``af``/``bf`` the same
with the fused kernels; ``b8``/``bf8`` storing fp8. ``--final-state`` stores the last layer's output too (every mode
then runs to the last layer, the floor too).

``modules``: each swapped module alone, stock against fused, on a few layers of the real shape, then the shallow
forward with its CUDA time by kernel family: the measurements that pick what to fuse next.

``shapes``: what a new batch shape costs in the steady state: the worker's own path (``load_model_for``, the
``Extractor``) runs one plan twice in one process; per batch, the time between two batches reaching the host in
pass 1 minus pass 2 (``figure NAME VALUE`` lines). ``--device cpu`` is a dry run on the demo's model.

``pinning``: the pipeline's pinned host buffers made two ways in fresh processes (PyTorch's caching host allocator;
``hsextract.startup.hostmem.pinned_empty``), and a device-to-host copy into them.

``--json-out`` writes everything, rewritten after each step so that a time limit keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from benchlib import ClockSampler, cuda_ms, extractor, realistic_samples

from hsextract.layers import resolve_layer_ids
from hsextract.model import qwen3_5 as kernels
from hsextract.model.capture import LayerCapture, _StopForward
from hsextract.model.load import decoder_layers, load_model
from hsextract.output import StateLayout, write_batch_file
from hsextract.prepare.plan import make_plan
from hsextract.run.pipeline import build_batch


def sync():
    torch.cuda.synchronize()


def model_and_batches(args, final_state: bool, device: str = "cuda"):
    """The target built from ``args.config`` with random bf16 weights, the layers a run stores (``args.layers``;
    the last one too with ``final_state``), the parameters of layers 0..deepest, and the realistic samples'
    length-sorted plan (``args.tokens``, ``args.max_tokens``, ``args.max_rows``, ``args.max_length``)."""
    import types

    t0 = time.perf_counter()
    lm = load_model(args.config, dtype="bfloat16", device=device, random_weights=True)
    build_s = time.perf_counter() - t0
    num_layers = lm.config.num_hidden_layers
    layer_ids = StateLayout(resolve_layer_ids(args.layers, num_layers), num_layers, final_state).slot_layers
    params = sum(p.numel() for p in decoder_layers(lm)[: max(layer_ids) + 1].parameters())
    samples = realistic_samples(args.tokens, lm.config.vocab_size, args.max_length)
    plan = make_plan(
        samples.lengths.tolist(), max_tokens_per_batch=args.max_tokens, max_rows=args.max_rows, shards=1
    )
    return types.SimpleNamespace(
        lm=lm, layer_ids=layer_ids, params=params, samples=samples, plan=plan, build_s=build_s
    )


def save_report(args, report: dict) -> None:
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))


# -- the forward alone, and inside a loop -------------------------------------------------------------------------
def bench_forward_only(lm, layer_ids, batches, samples, device, pad, captured=None, on_batch=None) -> float:
    """Seconds of one pass over ``batches``, each forward stopped after the deepest of ``layer_ids``. With
    ``captured`` (a dict), those layers' outputs land in it for ``on_batch(batch, inputs)`` after each forward."""
    layers = decoder_layers(lm)
    deepest = max(layer_ids)

    def hook_for(k):
        def hook(module, args, out):
            if captured is not None:
                captured[k] = out[0] if isinstance(out, tuple) else out
            if k == deepest:
                raise _StopForward

        return hook

    handles = [
        layers[k].register_forward_hook(hook_for(k))
        for k in (layer_ids if captured is not None else (deepest,))
    ]
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
                if on_batch is not None:
                    on_batch(b, x)
        sync()
        return time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()


def bench_hsextract(
    lm, layer_ids, batches, samples, device, pad, staging: Path, slots: int, storage_dtype=None
):
    ext = extractor(lm, layer_ids, batches, device, slots, storage_dtype)
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


def bench_naive(lm, layer_ids, batches, samples, device, pad, staging: Path) -> float:
    """(c): the captured layers' outputs gathered on the GPU, one blocking ``.cpu()`` per layer, ``save_file``."""
    from safetensors.torch import save_file

    captured: dict = {}

    def save(b, x):
        mask = x.attention_mask.to(device).bool()
        tensors = {f"layer_{k}": captured[k][mask].cpu() for k in layer_ids}  # blocks per layer
        tensors["input_ids"] = x.tokens_ids
        path = staging / f"naive-{b.batch_id:06d}.safetensors"
        save_file(tensors, str(path))
        path.unlink()

    return bench_forward_only(lm, layer_ids, batches, samples, device, pad, captured, save)


# -- variants: the forward against the capped GEMM rate ----------------------------------------------------------
VARIANTS = ("stock", "fused", "fused-mlp-separate", "fused-repeat-qk", "fused-fp8")


def capped_gemm(seconds: float, warm_s: float = 3.0, m: int = 32768, k: int = 5120, n: int = 17408) -> dict:
    """Sustained bf16 GEMM rate of the MLP's shape, after ``warm_s`` seconds of the same (clock settles at the cap)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def run_for(s):
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < s:
            for _ in range(10):
                torch.mm(a, b, out=out)
            sync()
            count += 10
        return count, time.perf_counter() - t0

    run_for(warm_s)
    with ClockSampler() as clocks:
        count, dt = run_for(seconds)
    return {"tflops": 2 * m * k * n * count / dt / 1e12, "shape": [m, k, n], "s": dt, **clocks.summary()}


class Variant:
    """Sets ``lm`` up as one variant, and puts back what it changed beyond ``kernels.apply``."""

    def __init__(self, lm, name: str):
        self.lm, self.name = lm, name
        self._undo = []

    def __enter__(self):
        kernels.apply(self.lm, "stock" if self.name == "stock" else "fused")
        if self.name == "fused-mlp-separate":
            for layer in decoder_layers(self.lm):
                mlp = layer.mlp
                joined = getattr(mlp, "_hsx_gate_up", None)
                mlp._hsx_gate_up = None
                self._undo.append(lambda mlp=mlp, j=joined: setattr(mlp, "_hsx_gate_up", j))
        elif self.name == "fused-repeat-qk":
            lib = kernels.libs()
            grouped = lib.chunk_gated_delta_rule

            def repeated(q, k, v, **kw):
                rep = v.shape[2] // q.shape[2]
                return grouped(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, **kw)

            lib.chunk_gated_delta_rule = repeated
            self._undo.append(lambda: setattr(lib, "chunk_gated_delta_rule", grouped))
        elif self.name == "fused-fp8":  # --compute fp8 on the bf16 weights, for good (the bf16 copies go)
            from hsextract.model import fp8

            kernels.restore(self.lm)
            for layer in decoder_layers(self.lm):
                layer.mlp.__dict__.pop("_hsx_gate_up", None)  # the joined bf16 gate/up, else kept alive
            fp8.to_fp8(self.lm)
            torch.cuda.empty_cache()
            kernels.apply(self.lm, "fused")
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        kernels.restore(self.lm)


def run_variants(args) -> None:
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def save():
        save_report(args, report)

    report["capped_gemm"] = gemm = capped_gemm(args.gemm_s)
    torch.cuda.empty_cache()
    print(
        f"capped GEMM {gemm['shape']}: {gemm['tflops']:.0f} TFLOP/s at "
        f"{gemm.get('sm_clock_mhz_mean', float('nan')):.0f} MHz, {gemm.get('power_w_mean', float('nan')):.0f} W",
        flush=True,
    )
    save()

    from hsextract.startup.warmup import tables as tuned

    setup = model_and_batches(args, final_state=False)
    lm, layer_ids, samples, plan = setup.lm, setup.layer_ids, setup.samples, setup.plan
    report["model_build_s"] = setup.build_s
    report["tuned_entries"] = tuned.install_here()
    deepest = max(layer_ids)
    flop_per_token = 2 * setup.params
    device = torch.device("cuda", 0)
    batches = list(plan.batches)
    real = plan.num_tokens
    padded = sum(b.padded_tokens for b in batches)
    report.update(
        layers=f"0..{deepest}",
        tokens=real,
        padded_tokens=padded,
        batches=len(batches),
        shapes=[[b.rows, b.padded_length] for b in batches],
        flop_per_token=flop_per_token,
    )
    print(
        f"{real} tokens ({padded} computed) in {len(batches)} batches, layers 0..{deepest}, "
        f"{flop_per_token / 1e9:.1f} GFLOP per token",
        flush=True,
    )

    def one_pass():
        return bench_forward_only(lm, layer_ids, batches, samples, device, 0)

    results = report.setdefault("variants", {})
    for name in variants:
        try:
            with Variant(lm, name):
                warm, best, clocks = measure(one_pass, args.repeat)
                tflops = padded * flop_per_token / best / 1e12
                results[name] = r = {
                    "s": best,
                    "warmup_s": warm,
                    "tokens_per_s": real / best,
                    "padded_tokens_per_s": padded / best,
                    "model_tflops": tflops,
                    "of_capped_gemm": tflops / gemm["tflops"],
                    **clocks,
                }
                print(
                    f"{name}: {r['tokens_per_s']:,.0f} real / {r['padded_tokens_per_s']:,.0f} computed tokens/s, "
                    f"{tflops:.0f} TFLOP/s = {r['of_capped_gemm']:.3f} of the capped GEMM, "
                    f"{r.get('sm_clock_mhz_mean', float('nan')):.0f} MHz, "
                    f"{r.get('power_w_mean', float('nan')):.0f} W (warm-up pass {warm:.1f} s)",
                    flush=True,
                )
                if name == (args.profile or variants[0]) and not args.no_profile:
                    report["profile"] = profile(one_pass, padded * flop_per_token, gemm["tflops"], name)
        except Exception:  # one variant failing keeps the others' figures
            import traceback

            traceback.print_exc()
            results[name] = {"error": traceback.format_exc()[-2000:]}
        save()

    lines = [
        "",
        f"| variant, layers 0..{deepest} | real tokens/s | computed tokens/s | model TFLOP/s | of capped GEMM | "
        "SM clock, power |",
        "|---|---|---|---|---|---|",
    ]
    results = {n: r for n, r in results.items() if "error" not in r}
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['padded_tokens_per_s']:,.0f} | {r['model_tflops']:.0f} | "
            f"{r['of_capped_gemm']:.3f} | {r.get('sm_clock_mhz_mean', float('nan')):.0f} MHz, "
            f"{r.get('power_w_mean', float('nan')):.0f} W |"
        )
    base = results.get("stock")
    if base:
        lines.append("")
        lines.append(
            "   ".join(
                f"{n} / stock = {r['padded_tokens_per_s'] / base['padded_tokens_per_s']:.3f}"
                for n, r in results.items()
                if n != "stock"
            )
        )
    if "fused" in results:
        f = results["fused"]["padded_tokens_per_s"]
        lines.append(
            "   ".join(
                f"{n} / fused = {r['padded_tokens_per_s'] / f:.3f}"
                for n, r in results.items()
                if n not in ("fused", "stock")
            )
        )
    print("\n".join(lines), flush=True)
    save()


def measure(one_pass, repeat: int) -> tuple[float, float, dict]:
    """An untimed pass (compiles, autotuning), then the best of ``repeat`` timed ones: (warm-up s, best s, the
    clock and power while the best ran)."""
    t0 = time.perf_counter()
    one_pass()
    warm = time.perf_counter() - t0
    best, clocks = None, {}
    for _ in range(repeat):
        with ClockSampler() as sampler:
            dt = one_pass()
        if best is None or dt < best:
            best, clocks = dt, sampler.summary()
    return warm, best, clocks


def profile(one_pass, flop: float, capped_tflops: float, name: str) -> dict:
    """CUDA time by kernel family over one pass, and the ceilings it implies."""
    fams, launches = kernel_breakdown(one_pass, steps=1)
    total = sum(v["ms"] for v in fams.values())
    gemm_ms = fams.get("matrix products", {}).get("ms", 0.0)
    fla_ms = fams.get("FLA chunk kernels", {}).get("ms", 0.0)
    out = {
        "variant": name,
        "kernels_per_pass": launches,
        "cuda_ms": total,
        "gemm_tflops": flop / (gemm_ms / 1e3) / 1e12 if gemm_ms else None,
        "families": fams,
    }
    # The forward's rate with the matrix products as they ran and the rest removed (or only FLA's kernels kept),
    # as a fraction of the capped GEMM rate.
    out["ceiling_no_other_kernels"] = flop / (gemm_ms / 1e3) / 1e12 / capped_tflops if gemm_ms else None
    out["ceiling_gemm_and_fla_only"] = (
        flop / ((gemm_ms + fla_ms) / 1e3) / 1e12 / capped_tflops if gemm_ms else None
    )
    out["forward_of_capped_from_profile"] = flop / (total / 1e3) / 1e12 / capped_tflops if total else None
    lines = [
        "",
        f"| kernel family, {name} forward, one pass | ms | share |",
        "|---|---|---|",
    ]
    for fam, v in sorted(fams.items(), key=lambda kv: -kv[1]["ms"]):
        lines.append(f"| {fam} | {v['ms']:.1f} | {100 * v['ms'] / total:.1f}% |")
    lines.append(f"| all ({launches} kernels) | {total:.1f} | 100% |")
    print("\n".join(lines), flush=True)
    print(
        f"matrix products alone: {out['gemm_tflops']:.0f} TFLOP/s; of the capped GEMM rate: forward "
        f"{out['forward_of_capped_from_profile']:.3f}, with only the matrix products "
        f"{out['ceiling_no_other_kernels']:.3f}, with the matrix products and FLA's chunk kernels "
        f"{out['ceiling_gemm_and_fla_only']:.3f}",
        flush=True,
    )
    print("top kernels:")
    for fam, v in sorted(fams.items(), key=lambda kv: -kv[1]["ms"]):
        for t, kname in v["top"][:4]:
            print(f"  {t:9.2f} ms  [{fam}] {kname}")
    return out


KERNEL_FAMILIES = [  # (family, regex on the CUDA kernel name), first match wins
    ("attention (sdpa)", r"sdpa|flash|fmha|attention|mha"),  # before conv: cuDNN's SDPA kernel says "fprop"
    ("causal conv", r"conv"),
    ("our q/k norm+rope, gate", r"qk_norm_rope|sigmoid_gate"),
    ("matrix products", r"gemm|cutlass|xmma|nvjet|cublas|s16816|wgmma"),
    ("FLA chunk kernels", r"chunk|delta|kkt|solve_tril|recompute_w_u|fwd_h|fwd_o|l2norm|beta_sigmoid"),
    ("fp8 quantizing kernels", r"quant"),
    ("norms", r"rms|norm"),
    ("silu * mul", r"swiglu|silu"),
    ("copies, casts, cat", r"copy|cpy|memset|cat|index|repeat|gather|scatter|fill"),
    ("other elementwise", r"elementwise|vectorized|unrolled|reduce"),
]


def kernel_breakdown(fn, steps: int = 3) -> tuple[dict, int]:
    """CUDA time per kernel family (ms per step) over ``steps`` calls of ``fn``, and kernels launched per step."""

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


# -- loop: the worker loop against the forward floor -------------------------------------------------------------
def loop(args) -> None:
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import fla  # noqa: F401

        report["flash_linear_attention"] = getattr(fla, "__version__", "installed")
    except ImportError:
        report["flash_linear_attention"] = None
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
    modes = args.modes.split(",")
    # The fp8-compute modes run last: converting to fp8 drops the bf16 weights for good.
    modes = [m for m in modes if not m.endswith("fp8")] + [m for m in modes if m.endswith("fp8")]
    for mode in modes:
        fused = mode in ("af", "bf", "bf8", "afp8", "bfp8")
        if mode.endswith("fp8") and "fp8" not in warmed:
            Variant(lm, "fused-fp8").__enter__()  # --compute fp8: the served recipe, block-scaled GEMMs
            warmed.discard(True)
            warmed.add("fp8")
        report.setdefault("kernels", {})[mode] = kernels.apply(lm, "fused" if fused else "stock")
        if fused not in warmed:
            warm_up("fused" if fused else "stock")
            warmed.add(fused)
        if mode in ("a", "af", "afp8"):
            dt = bench_forward_only(lm, layer_ids, batches, samples, device, 0)
        elif mode in ("b", "bf", "b8", "bf8", "bfp8"):
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
        "afp8": "(a'') forward of layers 0..deepest only, fused kernels, --compute fp8",
        "bfp8": "(b'') hsextract worker loop, fused kernels, --compute fp8",
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
    ratios += [("bf8", "af"), ("bf8", "bf"), ("afp8", "af"), ("bfp8", "afp8"), ("bfp8", "bf")]
    lines.append(
        "\n" + "   ".join(f"({x})/({y}) = {tps[x] / tps[y]:.3f}" for x, y in ratios if x in tps and y in tps)
    )
    lines[-1] = lines[-1].replace("(af)", "(a')").replace("(bf8)", "(b8')").replace("(bf)", "(b')")
    print("\n".join(lines), flush=True)
    save_report(args, report)


# -- modules: each swapped module alone, then the shallow forward ------------------------------------------------
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


def modules(args) -> None:
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
    lib = kernels.libs()
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
                times.setdefault(name, {})[mode] = cuda_ms(pair[mode == "fused"])
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
                ms = cuda_ms(forward, reps=5)
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
    save_report(args, out)


# -- shapes: what a new batch shape costs -------------------------------------------------------------------------
def prewarm(cfg, plan, work: Path) -> None:
    """The run's warm-up (``hsextract.startup.warmup``) for ``plan``, into a fresh kernel cache this process then
    uses (set before Triton is imported: the warm-up's kernels are the ones the passes find)."""
    import os
    import shutil
    import subprocess

    from hsextract.startup.begin import warmup_spec

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    warmup_spec(cfg, plan).save(work / "warmup.json")
    os.environ["TRITON_CACHE_DIR"] = str(work / "kernels")
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "hsextract.startup.warmup", str(work / "warmup.json")],
        capture_output=True,
        text=True,
    )
    print(f"figure prewarm_s {time.perf_counter() - t0:.1f}", flush=True)
    print(f"figure prewarm_exit {r.returncode}", flush=True)
    if r.returncode != 0:
        print(r.stdout[-1500:] + r.stderr[-1500:], flush=True)


def shapes(args) -> None:
    from hsextract.config import RunConfig
    from hsextract.model.load import load_model_config, load_model_for
    from hsextract.startup import fast_load, ready

    cfg = RunConfig(
        model=args.model,
        data="unused",
        output="/tmp/unused",
        run_dir="/tmp/unused-run",
        device=args.device,
        dtype="bfloat16",
        max_length=args.max_length,
        max_tokens_per_batch=args.max_tokens,
    )
    _, text, num_layers = load_model_config(args.model)
    layers = StateLayout(resolve_layer_ids(cfg.layers, num_layers), num_layers, False, None).slot_layers
    samples = realistic_samples(args.tokens, min(text.vocab_size, 32000), args.max_length, seed=args.seed)
    lengths = samples.lengths.tolist()
    plan = make_plan(lengths, max_tokens_per_batch=args.max_tokens, max_rows=cfg.max_rows, shards=1)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.prewarm:
        prewarm(cfg, plan, Path(args.work))
    t0 = time.perf_counter()
    lm = load_model_for(cfg, device, fast_load)
    ready(device)
    print(f"figure load_s {time.perf_counter() - t0:.1f}", flush=True)
    ext = extractor(lm, layers, plan.batches, device, num_slots=3)
    passes = []
    for p in range(2):
        seen: list[tuple[int, float]] = []
        with ClockSampler() as sampler:
            t0 = time.perf_counter()
            ext.run(
                plan.batches, samples, lambda b, t, seen=seen: seen.append((b.batch_id, time.perf_counter()))
            )
            wall = time.perf_counter() - t0
        passes.append((dict(seen), [b for b, _ in seen], wall, sampler.summary()))
        tokens = sum(b.num_tokens for b in plan.batches)
        padded = sum(b.rows * b.padded_length for b in plan.batches)
        print(f"figure pass{p + 1}.wall_s {wall:.2f}", flush=True)
        print(f"figure pass{p + 1}.tokens_per_s {tokens / wall:.0f}", flush=True)
        print(f"figure pass{p + 1}.padded_tokens_per_s {padded / wall:.0f}", flush=True)
        for key, value in passes[-1][3].items():
            print(f"figure pass{p + 1}.{key} {value}", flush=True)
    (t1, order, *_), (t2, *_) = passes
    rows = []
    by_id = {b.batch_id: b for b in plan.batches}
    for prev, cur in zip(order, order[1:], strict=False):
        b = by_id[cur]
        a, c = t1[cur] - t1[prev], t2[cur] - t2[prev]
        rows.append(
            {
                "batch": cur,
                "rows": b.rows,
                "padded_length": b.padded_length,
                "tokens": b.num_tokens,
                "pass1_s": round(a, 3),
                "pass2_s": round(c, 3),
                "new_shape_s": round(a - c, 3),
            }
        )
    extra = [r["new_shape_s"] for r in rows]
    print(f"figure batches {len(plan.batches)}", flush=True)
    print(f"figure new_shape_s_median {statistics.median(extra):.3f}", flush=True)
    print(f"figure new_shape_s_max {max(extra):.3f}", flush=True)
    print(f"figure per_batch {json.dumps(rows)}", flush=True)


# -- pinning: the pinned host buffers ----------------------------------------------------------------------------
PROBE = """
import json, sys, time, torch
way, slots, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.empty(1, device="cuda")
t0 = time.perf_counter()
if way == "torch":
    bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
else:
    from hsextract.startup.hostmem import pinned_empty
    bufs = [pinned_empty(nbytes) for _ in range(slots)]
made = time.perf_counter() - t0
src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
bufs[0].copy_(src, non_blocking=True)
torch.cuda.synchronize()
t1 = time.perf_counter()
for b in bufs:
    b.copy_(src, non_blocking=True)
torch.cuda.synchronize()
copy = time.perf_counter() - t1
print(json.dumps({"made_s": round(made, 2), "d2h_gbps": round(slots * nbytes / copy / 1e9, 1),
                  "pinned": all(b.is_pinned() for b in bufs)}))
"""


def pinning(args) -> None:
    nbytes = int(args.gb * 1e9)
    for way in ("torch", "register"):
        r = subprocess.run(
            [sys.executable, "-c", PROBE, way, str(args.slots), str(nbytes)], capture_output=True, text=True
        )
        if r.returncode != 0:
            print(f"figure {way}.error {json.dumps(r.stderr[-800:])}", flush=True)
            continue
        for key, value in json.loads(r.stdout.strip().splitlines()[-1]).items():
            print(f"figure {way}.{key} {json.dumps(value)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    v = sub.add_parser(
        "variants", help="each variant's forward against the capped GEMM rate, and its profile"
    )
    lp = sub.add_parser("loop", help="the worker loop against the forward floor and a naive loop")
    for p, tokens in ((v, 200_000), (lp, 400_000)):
        p.add_argument("--config", default="configs/qwen3.6-27b")
        p.add_argument("--layers", default="dflash")
        p.add_argument("--tokens", type=int, default=tokens, help="tokens per timed pass")
        p.add_argument("--max-tokens", type=int, default=65536)
        p.add_argument("--max-rows", type=int, default=512)
        p.add_argument("--max-length", type=int, default=8192)
        p.add_argument("--json-out")
    v.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    v.add_argument("--repeat", type=int, default=1, help="timed passes per variant (the best is kept)")
    v.add_argument("--gemm-s", type=float, default=8.0)
    v.add_argument("--no-profile", action="store_true")
    v.add_argument("--profile", help="the variant to profile (default: the first)")
    lp.add_argument("--slots", type=int, default=3)
    lp.add_argument("--staging", default="/dev/shm/hsextract-bench")
    lp.add_argument(
        "--modes",
        default="a,b,c,af,bf",
        help="a, b, c stock; af, bf = (a'), (b') with fused kernels; b8, bf8 = (b), (b') storing fp8; "
        "afp8, bfp8 = (a'), (b') with --compute fp8 (run last: the bf16 weights go)",
    )
    lp.add_argument(
        "--final-state", action="store_true", help="store the last layer's output too (run to it)"
    )
    m = sub.add_parser(
        "modules", help="each swapped module alone, stock against fused, then the shallow forward"
    )
    m.add_argument("--config", default="configs/qwen3.6-27b")
    m.add_argument("--profile-layers", type=int, default=8)
    m.add_argument("--profile-rows", type=int, default=64)
    m.add_argument("--profile-length", type=int, default=1024)
    m.add_argument("--json-out")
    sh = sub.add_parser("shapes", help="what a new batch shape costs in the steady state")
    sh.add_argument("--model", required=True)
    sh.add_argument("--tokens", type=int, default=200000)
    sh.add_argument("--max-tokens", type=int, default=65536)
    sh.add_argument("--max-length", type=int, default=4096)
    sh.add_argument(
        "--seed", type=int, default=7, help="another seed, other shapes than the start-up bench's"
    )
    sh.add_argument("--device", default="cuda", help="cpu: a dry run of the script (the demo's tiny model)")
    sh.add_argument(
        "--prewarm",
        action="store_true",
        help="first run the run's kernel warm-up for this plan into a fresh kernel cache, as `hsextract run` does "
        "beside its load (without: the kernels of new shapes compile in the passes)",
    )
    sh.add_argument("--work", default="/tmp/hsextract-bench-shapes")
    pn = sub.add_parser("pinning", help="pinned host buffers made two ways, and a copy into them")
    pn.add_argument("--slots", type=int, default=3)
    pn.add_argument("--gb", type=float, default=2.75)
    args = ap.parse_args()
    {"variants": run_variants, "loop": loop, "modules": modules, "shapes": shapes, "pinning": pinning}[
        args.what
    ](args)


if __name__ == "__main__":
    main()
