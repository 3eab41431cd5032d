"""The forward's cost of the target's top-k (``--target-topk K``) against the capture it rides on.

    python3 scripts/bench_topk.py --tokens 200000 --k 64

Builds the target from its config with random bf16 weights and the realistic, length-sorted batches of
scripts/bench_forward.py's loop mode, sets the fused kernels up as a run does, and times the worker's own pipeline (run/pipeline.py's
``Extractor``: hooks, on-device gather, pinned copies on a side stream, a writer thread that drops the tensors)
over the same batches for:

- ``dflash``: the preset alone, the forward stopping after its deepest layer (61 of 64);
- ``dflash + final state``: the forward to the last layer, its output stored (what the two extra layers cost);
- ``dflash + top-K``: the forward to the last layer, the final norm and ``lm_head`` on the valid tokens in chunks,
  log-softmax in float32 and top-K on the device, K ids and log-probabilities per token copied to the host.

Each variant gets an untimed pass (compiles, autotuning), then the best of ``--repeat``. Prints one markdown table
(real tokens/s, the ratio to ``dflash`` alone, bytes per token stored); ``--json-out`` writes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_forward import Variant, measure, model_and_batches, sync  # noqa: E402

from hsextract.layers import resolve_layer_ids  # noqa: E402
from hsextract.output import StateLayout  # noqa: E402
from hsextract.run.pipeline import Extractor  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3.6-27b")
    ap.add_argument("--layers", default="dflash")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200_000, help="tokens per timed pass")
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--max-rows", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=2, help="timed passes per variant (the best is kept)")
    ap.add_argument("--json-out")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script with a tiny --config")
    args = ap.parse_args()
    on_cuda = args.device == "cuda"
    gpu = torch.cuda.get_device_name(0) if on_cuda else "cpu"
    report: dict = {"gpu": gpu, "torch": torch.__version__, "k": args.k}

    def save():
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=1))

    from hsextract.startup.warmup import tables as tuned

    setup = model_and_batches(args, final_state=False, device=args.device)
    lm, samples, plan = setup.lm, setup.samples, setup.plan
    report["tuned_entries"] = tuned.install_here()
    num_layers = lm.config.num_hidden_layers
    hidden = lm.config.hidden_size
    ids = resolve_layer_ids(args.layers, num_layers)
    device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    batches = list(plan.batches)
    max_tokens = max(b.num_tokens for b in batches)
    report.update(
        tokens=plan.num_tokens, batches=len(batches), padded_tokens=sum(b.padded_tokens for b in batches)
    )
    print(
        f"{plan.num_tokens} tokens in {len(batches)} batches, layers {args.layers} = {list(ids)}", flush=True
    )
    variants = {
        args.layers: StateLayout(ids, num_layers),
        f"{args.layers} + final state": StateLayout(ids, num_layers, final_state=True),
        f"{args.layers} + top-{args.k}": StateLayout(ids, num_layers, target_topk=args.k),
    }
    results = report.setdefault("variants", {})
    wait = sync if on_cuda else (lambda: None)
    with Variant(lm, "fused") if on_cuda else contextlib.nullcontext():
        for name, layout in variants.items():
            try:
                extractor = Extractor(
                    lm,
                    layout.slot_layers,
                    device=device,
                    max_tokens=max_tokens,
                    num_slots=3,
                    pad_token_id=0,
                    target_topk=layout.target_topk,
                )

                def one_pass(extractor=extractor):
                    wait()
                    t0 = time.perf_counter()
                    extractor.run(batches, samples, lambda b, t: None)
                    wait()
                    return time.perf_counter() - t0

                warm, best, clocks = measure(one_pass, args.repeat)
                results[name] = r = {
                    "s": best,
                    "warmup_s": warm,
                    "tokens_per_s": plan.num_tokens / best,
                    "layers_run": layout.layers_run,
                    "bytes_per_token": layout.bytes_per_token(hidden, 2),
                    **clocks,
                }
                print(
                    f"{name}: {r['tokens_per_s']:,.0f} real tokens/s (warm-up pass {warm:.1f} s)", flush=True
                )
                del extractor
                if on_cuda:
                    torch.cuda.empty_cache()
            except Exception:  # one variant failing keeps the others' figures
                import traceback

                traceback.print_exc()
                results[name] = {"error": traceback.format_exc()[-2000:]}
            save()
    ok = {n: r for n, r in results.items() if "error" not in r}
    base = ok.get(args.layers)
    lines = [
        "",
        "| capture | layers run | real tokens/s | vs preset alone | bytes/token stored | SM clock, power |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in ok.items():
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "-"
        lines.append(
            f"| {name} | 0..{r['layers_run'] - 1} | {r['tokens_per_s']:,.0f} | {ratio} | {r['bytes_per_token']:,} | "
            f"{r.get('sm_clock_mhz_mean', float('nan')):.0f} MHz, {r.get('power_w_mean', float('nan')):.0f} W |"
        )
    print("\n".join(lines), flush=True)
    save()


if __name__ == "__main__":
    main()
