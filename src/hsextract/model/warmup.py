"""Pre-warm flash-linear-attention's Triton kernels into the kernel cache, while the shards load their weights.

FLA compiles its Triton kernels on first use and autotunes some per token count: minutes over a realistic plan,
and N shards compiling the same kernels at once starve the CPU. So the launcher (run/prewarm.py) points every
process at one per-user kernel cache (model/kernel_cache.py) and, unless the cache's stamp already covers the
plan, runs this module once (``python -m hsextract.model.warmup RUN_DIR``) on the first GPU, beside the shards'
weight load; the shards wait for it before their first batch. It

1. builds a shallow random-weight copy of the target (the first few layers, enough to contain every layer type,
   so every kernel is met) with the run's kernels and the pinned autotune keys (model/autotune.py);
2. runs a forward on a spread of the plan's batch shapes that the stamp lacks, the largest first (the tuning of
   the pinned kernels happens there), with one shape of every missing shape class;
3. runs the token-count-keyed norm kernels alone (no forward) for every token-count bucket still missing, largest
   first, until ``HSEXTRACT_WARMUP_BUCKET_S`` seconds have passed (what is left is compiled by the run);
4. adds what it warmed to the stamp, so the next job with these shapes skips the warm-up.

Nothing here touches the real weights, so the warm-up costs seconds of loading, not minutes.
"""

from __future__ import annotations

import json
import os
import sys
import time

BUCKET_BUDGET_ENV = "HSEXTRACT_WARMUP_BUCKET_S"


DEFAULT_BUCKET_BUDGET_S = 90.0


def fla_available() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def warm_shapes(shapes, limit: int = 24, must=()) -> list[tuple[int, int]]:
    """(rows, padded_length) of up to ``limit`` shapes spread over ``shapes``, the largest (rows x length) and the
    smallest included, largest first, plus those of ``must`` (one per shape class)."""
    shapes = sorted(set(shapes), key=lambda s: (-s[0] * s[1], -s[1]))
    if len(shapes) > limit:
        step = (len(shapes) - 1) / (limit - 1)
        shapes = [shapes[round(i * step)] for i in range(limit)]
    extra = [s for s in dict.fromkeys(must) if s not in shapes]
    return sorted(shapes + extra, key=lambda s: (-s[0] * s[1], -s[1]))


def plan_shapes(plan, missing, heads) -> list[tuple[int, int]]:
    """The shapes to run a forward on: a spread of the batches whose bucket or class is missing, and one batch
    of each missing class."""
    from hsextract.model.kernel_cache import batch_needs

    wanted, by_class = [], {}
    for b in plan.batches:
        need = batch_needs(b.rows, b.padded_length, heads)
        if need.buckets & missing.buckets or need.classes & missing.classes:
            wanted.append((b.rows, b.padded_length))
        for c in need.classes & missing.classes:
            by_class.setdefault(c, (b.rows, b.padded_length))
    return warm_shapes(wanted, must=by_class.values())


def warm_bucket(decoder, text, kernel_mode: str, padded_tokens: int, dtype, device) -> None:
    """Run the kernels that autotune per token count (FLA's q/k l2 norm, the gated norm) alone, on the rows a
    batch of ``padded_tokens`` gives them, through the same entry points the forward calls."""
    import torch

    from hsextract.model.kernel_cache import bucket_heads

    gdn = next(m for m in decoder.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    h_l2, hv = bucket_heads(text, kernel_mode)
    dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
    x = torch.randn(padded_tokens * hv, dv, device=device, dtype=dtype)
    gdn.norm(x, torch.randn_like(x))
    del x
    if fla_available():
        from fla.modules.l2norm import l2norm_fwd

        l2norm_fwd(torch.randn(padded_tokens * h_l2, dk, device=device, dtype=dtype))


def main(argv=None) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hsextract.config import RunConfig
    from hsextract.layers import layer_types
    from hsextract.model import kernel_cache, tuned
    from hsextract.model import qwen3_5 as kernels
    from hsextract.model.autotune import pin_token_count_autotune
    from hsextract.model.load import base_model
    from hsextract.prepare.plan import Plan
    from hsextract.run.rundir import RunDir

    argv = sys.argv[1:] if argv is None else argv
    run_dir = RunDir(argv[0])
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    cfg = RunConfig.load(run_dir.config_file)
    plan = Plan.load(run_dir.plan_file)
    text = AutoConfig.from_pretrained(cfg.model).get_text_config()
    signature = kernel_cache.run_signature(cfg, text)
    heads = kernel_cache.bucket_heads(text, cfg.kernel_mode)
    need = kernel_cache.plan_needs(plan.batches, heads)
    missing = need.minus(kernel_cache.read_stamp(cache_dir, signature)) if cache_dir else need
    if not missing:  # another job warmed it meanwhile
        print(json.dumps({"warmup_s": 0.0, "shapes": 0, "covered_by_stamp": True}), flush=True)
        return 0
    types = layer_types(text)
    depth = next((i + 1 for i in range(len(types)) if set(types[: i + 1]) == set(types)), len(types))
    text.num_hidden_layers = depth
    if getattr(text, "layer_types", None):
        text.layer_types = types[:depth]
    text._attn_implementation = cfg.attn_implementation
    t0 = time.time()
    dtype = getattr(torch, cfg.dtype)
    with torch.device("cuda"):
        lm = AutoModelForCausalLM.from_config(text, dtype=dtype)
    lm.eval()
    kernels.apply(lm, cfg.kernel_mode)  # compile the kernels the shards will run
    pinned = pin_token_count_autotune()
    answered = tuned.install_here()  # recorded choices: one compile per kernel, no timing of candidates
    decoder = base_model(lm)
    t_built = time.time()
    shapes = plan_shapes(plan, missing, heads)
    warmed = kernel_cache.WarmSet()
    with torch.inference_mode():
        for rows, length in shapes:
            ids = torch.randint(0, text.vocab_size, (rows, length), device="cuda")
            mask = torch.ones_like(ids)
            mask[1:, length // 2 :] = 0  # padded rows, as in real batches
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
            warmed = warmed.union(kernel_cache.batch_needs(rows, length, heads))
        torch.cuda.synchronize()
        t_forwards = time.time()
        budget = float(os.environ.get(BUCKET_BUDGET_ENV, DEFAULT_BUCKET_BUDGET_S))
        left = {
            max(b.rows * b.padded_length for b in plan.batches if _bucket(b, heads) == bucket)
            for bucket in missing.buckets - warmed.buckets
        }
        direct = 0
        for tokens in sorted(left, reverse=True):
            if time.time() - t_forwards > budget:
                break
            warm_bucket(decoder, text, cfg.kernel_mode, tokens, dtype, "cuda")
            warmed.buckets.add(kernel_cache.token_bucket(tokens, heads))
            direct += 1
        torch.cuda.synchronize()
    if cache_dir:
        recorded = tuned.record_here(cache_dir)
        kernel_cache.add_to_stamp(cache_dir, signature, warmed)
    report = {
        "warmup_s": round(time.time() - t0, 2),
        "build_s": round(t_built - t0, 2),
        "forwards_s": round(t_forwards - t_built, 2),
        "buckets_s": round(time.time() - t_forwards, 2),
        "shapes": len(shapes),
        "buckets_direct": direct,
        "buckets_left": len(missing.buckets - warmed.buckets),
        "layers": depth,
        "pinned": pinned,
        "tuned_installed": answered,
        "tuned_recorded": recorded if cache_dir else None,
    }
    print(json.dumps(report), flush=True)
    return 0


def _bucket(batch, heads):
    from hsextract.model.kernel_cache import token_bucket

    return token_bucket(batch.rows * batch.padded_length, heads)


if __name__ == "__main__":
    sys.exit(main())
