"""GPU benchmark: hsextract's worker loop against the forward floor and a naive blocking loop, in one process.

    python scripts/bench.py --config configs/qwen3.6-27b --tokens 400000

Builds the architecture from a config with random bf16 weights (no download), makes length-sorted batches of a
realistic length mix (median 221, mean ~330, p99 ~1800 tokens), and times on the same batches:

  (a) forward of the needed layers only (early exit after the deepest id, no capture): the floor;
  (b) hsextract's Extractor end to end: hooks, on-device gather, async copy into pinned buffers on a side stream,
      writer thread saving safetensors files to /dev/shm (each file removed after it is written, as the uploader
      would);
  (c) a naive loop: hooks, GPU concat, one blocking ``.cpu()`` per layer, synchronous ``safetensors.save_file``.

Prints tokens/s, (b)/(a), (b)/(c) and model TFLOP/s (2 x parameters of layers 0..deepest per token).
``--startup`` also measures time to the first batch in fresh processes with an empty and a warm Triton cache.
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

from hsextract.capture import LayerCapture, _StopForward, decoder_layers, load_model, resolve_layer_ids  # noqa: E402
from hsextract.data import TokenizedSamples  # noqa: E402
from hsextract.pipeline import Extractor, build_batch  # noqa: E402
from hsextract.plan import make_plan  # noqa: E402
from hsextract.writer import write_safetensors  # noqa: E402


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


def bench_hsextract(lm, layer_ids, batches, samples, device, pad, staging: Path, slots: int):
    ext = Extractor(
        lm,
        layer_ids,
        device=device,
        max_tokens=max(b.num_tokens for b in batches),
        num_slots=slots,
        pad_token_id=pad,
    )
    written = []

    def on_batch(b, tensors):
        path = staging / f"batch-{b.batch_id:06d}.safetensors"
        written.append(write_safetensors(path, tensors, {"batch_id": str(b.batch_id)}))
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


def startup_probe(args) -> None:
    """Child mode: build a shallow model of the config's shape, time the first batches (Triton compiles here)."""
    t_start = time.perf_counter()
    cfg_dir = Path(args.startup_model)
    lm = load_model(str(cfg_dir), dtype="bfloat16", device="cuda", random_weights=True)
    t_model = time.perf_counter() - t_start
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
    t0 = time.perf_counter()
    ext.run(batches[:1], samples, lambda b, t: None)
    sync()
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    ext.run(batches, samples, lambda b, t: None)
    sync()
    t_all = time.perf_counter() - t0
    print(json.dumps({"model_s": t_model, "first_batch_s": t_first, f"{len(batches)}_batch_shapes_s": t_all}))


def measure_startup(args) -> dict:
    """Fresh processes: empty Triton cache (cold) then the same cache again (warm)."""
    shallow = Path(tempfile.mkdtemp()) / "shallow"
    shallow.mkdir()
    cfg = json.loads((Path(args.config) / "config.json").read_text())
    cfg["num_hidden_layers"] = (
        4  # 3 Gated-DeltaNet + 1 full attention: every kernel, a fraction of the weights
    )
    (shallow / "config.json").write_text(json.dumps(cfg))
    cache = Path(tempfile.mkdtemp(prefix="triton-"))
    out = {}
    for label in ("cold_cache", "warm_cache"):
        env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
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
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            out[label] = {"error": r.stderr[-2000:]}
            continue
        out[label] = {"process_wall_s": wall, **json.loads(r.stdout.strip().splitlines()[-1])}
    shutil.rmtree(cache, ignore_errors=True)
    return out


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
    ap.add_argument("--modes", default="a,b,c")
    ap.add_argument("--startup", action="store_true")
    ap.add_argument("--startup-model")
    ap.add_argument("--startup-batches", type=int, default=12)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.startup_model:
        return startup_probe(args)

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

    t0 = time.perf_counter()
    lm = load_model(args.config, dtype="bfloat16", device="cuda", random_weights=True)
    report["model_build_s"] = time.perf_counter() - t0
    num_layers = lm.config.num_hidden_layers
    layer_ids = resolve_layer_ids(args.layers, num_layers)
    deepest = max(layer_ids)
    params = sum(p.numel() for p in decoder_layers(lm)[: deepest + 1].parameters())
    device = torch.device("cuda", 0)
    samples = realistic_samples(args.tokens, lm.config.vocab_size, args.max_length)
    plan = make_plan(
        samples.lengths.tolist(), max_tokens_per_batch=args.max_tokens, max_rows=args.max_rows, shards=1
    )
    batches = list(plan.batches)
    tokens = plan.num_tokens
    report.update(
        layer_ids=list(layer_ids), tokens=tokens, batches=len(batches), padding_waste=plan.padding_waste
    )
    print(
        f"{tokens} tokens in {len(batches)} batches, padding waste {100 * plan.padding_waste:.2f}%",
        flush=True,
    )

    # Warm-up: every batch shape once, so Triton compilation stays out of the timings.
    t0 = time.perf_counter()
    bench_forward_only(lm, layer_ids, batches, samples, device, 0)
    report["warmup_s"] = time.perf_counter() - t0
    print(f"warm-up pass {report['warmup_s']:.1f} s", flush=True)

    staging = Path(args.staging)
    staging.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in args.modes.split(","):
        if mode == "a":
            dt = bench_forward_only(lm, layer_ids, batches, samples, device, 0)
        elif mode == "b":
            dt, nbytes = bench_hsextract(lm, layer_ids, batches, samples, device, 0, staging, args.slots)
            report["bytes_written"] = nbytes
        elif mode == "c":
            dt = bench_naive(lm, layer_ids, batches, samples, device, 0, staging)
        results[mode] = tokens / dt
        print(f"({mode}) {tokens / dt:,.0f} tokens/s  ({dt:.1f} s)", flush=True)
    report["tokens_per_s"] = results
    flop_per_token = 2 * params
    lines = ["", "| loop | tokens/s | vs (a) | model TFLOP/s |", "|---|---|---|---|"]
    names = {
        "a": "(a) forward of layers 0..deepest only",
        "b": "(b) hsextract worker loop, files to /dev/shm",
        "c": "(c) blocking .cpu() per layer + sync save_file",
    }
    for mode, tps in results.items():
        ratio = tps / results["a"] if "a" in results else float("nan")
        lines.append(f"| {names[mode]} | {tps:,.0f} | {ratio:.3f} | {tps * flop_per_token / 1e12:,.0f} |")
    if "b" in results and "c" in results:
        lines.append(
            f"\n(b)/(a) = {results['b'] / results['a']:.3f}   (b)/(c) = {results['b'] / results['c']:.3f}"
        )
    print("\n".join(lines), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
