"""The warm-up process: compiles FLA's Triton kernels for a run's batch shapes into the kernel cache.

``python -m hsextract.startup.warmup SPEC`` (a ``WarmupSpec`` written by ``Warmup.start``) on the first GPU, beside
the shards' weight load, on a shallow random-weight copy of the target (every layer type, so every kernel is met,
in seconds): forwards on the shapes the stamp lacks, then the token-count-keyed norm kernels alone per missing
bucket; it adds what it warmed to the stamp and its autotune choices to the cache's table.
"""

# The forwards run on a spread of the shapes the stamp lacks, largest first (where the pinned kernels tune); the
# norm kernels alone for each bucket still missing, until ``HSEXTRACT_WARMUP_BUCKET_S`` have passed.

from __future__ import annotations

import json
import os
import sys
import time

from hsextract.startup.warmup import fla_patch, ready_kernels, tables
from hsextract.startup.warmup.cache import (
    WarmSet,
    add_to_stamp,
    batch_needs,
    bucket_heads,
    plan_needs,
    read_stamp,
    token_bucket,
)
from hsextract.startup.warmup.fla_patch import fla_available
from hsextract.startup.warmup.launch import WarmupSpec

BUCKET_BUDGET_ENV = "HSEXTRACT_WARMUP_BUCKET_S"


DEFAULT_BUCKET_BUDGET_S = 90.0


def warm_shapes(shapes, limit: int = 24, must=()) -> list[tuple[int, int]]:
    """(rows, padded_length) of up to ``limit`` shapes spread over ``shapes``, the largest (rows x length) and the
    smallest included, largest first, plus those of ``must`` (one per shape class)."""
    shapes = sorted(set(shapes), key=lambda s: (-s[0] * s[1], -s[1]))
    if len(shapes) > limit:
        step = (len(shapes) - 1) / (limit - 1)
        shapes = [shapes[round(i * step)] for i in range(limit)]
    extra = [s for s in dict.fromkeys(must) if s not in shapes]
    return sorted(shapes + extra, key=lambda s: (-s[0] * s[1], -s[1]))


def plan_shapes(shapes, missing: WarmSet, heads) -> list[tuple[int, int]]:
    """The shapes to run a forward on: a spread of the batch shapes whose bucket or class is missing, and one of
    each missing class."""
    wanted, by_class = [], {}
    for shape in shapes:
        need = batch_needs(*shape, heads)
        if need.buckets & missing.buckets or need.classes & missing.classes:
            wanted.append(tuple(shape))
        for c in need.classes & missing.classes:
            by_class.setdefault(c, tuple(shape))
    return warm_shapes(wanted, must=by_class.values())


def warm_bucket(decoder, text, kernel_mode: str, padded_tokens: int, dtype, device) -> None:
    """Run the kernels that autotune per token count (FLA's q/k l2 norm, the gated norm) alone, on the rows a
    batch of ``padded_tokens`` gives them, through the same entry points the forward calls."""
    import torch

    gdn = next(m for m in decoder.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    h_l2, hv = bucket_heads(text, kernel_mode)
    dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
    x = torch.randn(padded_tokens * hv, dv, device=device, dtype=dtype)
    gdn.norm(x, torch.randn_like(x))
    del x
    if fla_available():
        fla_patch.l2norm_fwd()(torch.randn(padded_tokens * h_l2, dk, device=device, dtype=dtype))


def main(argv=None) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hsextract.layers import layer_types
    from hsextract.model import qwen3_5 as kernels
    from hsextract.model.load import base_model

    argv = sys.argv[1:] if argv is None else argv
    spec = WarmupSpec.load(argv[0])
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    text = AutoConfig.from_pretrained(spec.model).get_text_config()
    signature = spec.signature(text)
    heads = bucket_heads(text, spec.kernel_mode)
    need = plan_needs(spec.shapes, heads)
    missing = need.minus(read_stamp(cache_dir, signature)) if cache_dir else need
    if not missing:  # another job warmed it meanwhile
        print(json.dumps({"warmup_s": 0.0, "shapes": 0, "covered_by_stamp": True}), flush=True)
        return 0
    types = layer_types(text)
    depth = next((i + 1 for i in range(len(types)) if set(types[: i + 1]) == set(types)), len(types))
    text.num_hidden_layers = depth
    if getattr(text, "layer_types", None):
        text.layer_types = types[:depth]
    text._attn_implementation = spec.attn_implementation
    t0 = time.time()
    dtype = getattr(torch, spec.dtype)
    with torch.device("cuda"):
        lm = AutoModelForCausalLM.from_config(text, dtype=dtype)
    lm.eval()
    kernels.apply(lm, spec.kernel_mode)  # compile the kernels the shards will run
    # As every worker: pinned keys, recorded choices (one compile per kernel, no timing of candidates).
    ready = ready_kernels()
    decoder = base_model(lm)
    t_built = time.time()
    shapes = plan_shapes(spec.shapes, missing, heads)
    warmed = WarmSet()
    with torch.inference_mode():
        for rows, length in shapes:
            ids = torch.randint(0, text.vocab_size, (rows, length), device="cuda")
            mask = torch.ones_like(ids)
            mask[1:, length // 2 :] = 0  # padded rows, as in real batches
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
            warmed = warmed.union(batch_needs(rows, length, heads))
        torch.cuda.synchronize()
        t_forwards = time.time()
        budget = float(os.environ.get(BUCKET_BUDGET_ENV, DEFAULT_BUCKET_BUDGET_S))
        tokens_of = {}  # bucket -> the most tokens a batch in it has
        for rows, length in spec.shapes:
            bucket = token_bucket(rows * length, heads)
            tokens_of[bucket] = max(tokens_of.get(bucket, 0), rows * length)
        left = {tokens_of[bucket] for bucket in missing.buckets - warmed.buckets}
        direct = 0
        for tokens in sorted(left, reverse=True):
            if time.time() - t_forwards > budget:
                break
            warm_bucket(decoder, text, spec.kernel_mode, tokens, dtype, "cuda")
            warmed.buckets.add(token_bucket(tokens, heads))
            direct += 1
        torch.cuda.synchronize()
    if cache_dir:
        recorded = tables.record_here(cache_dir)
        add_to_stamp(cache_dir, signature, warmed)
    report = {
        "warmup_s": round(time.time() - t0, 2),
        "build_s": round(t_built - t0, 2),
        "forwards_s": round(t_forwards - t_built, 2),
        "buckets_s": round(time.time() - t_forwards, 2),
        "shapes": len(shapes),
        "buckets_direct": direct,
        "buckets_left": len(missing.buckets - warmed.buckets),
        "layers": depth,
        "pinned": ready["pinned"],
        "tuned_installed": ready["tuned"],
        "tuned_recorded": recorded if cache_dir else None,
    }
    print(json.dumps(report), flush=True)
    return 0
