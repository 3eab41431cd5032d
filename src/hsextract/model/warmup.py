"""Pre-warm flash-linear-attention's Triton kernels once, before the shards start.

FLA compiles its Triton kernels on first use: about a minute for the first batch and two to warm every batch shape
of a realistic plan. N shards compiling the same kernels at once starve the CPU and each pay the full cost. So the
launcher points every process at one shared ``TRITON_CACHE_DIR`` in the run directory and, before the shards
start, runs this module once (``python -m hsextract.model.warmup RUN_DIR``) on the first GPU: a shallow random-weight copy
of the target (the first few layers, enough to contain every layer type, so every kernel is met) runs a forward on
a spread of the plan's batch shapes. The shards then find the kernels compiled. Nothing here touches the real
weights, so the warm-up costs seconds of loading, not minutes.
"""

from __future__ import annotations

import json
import sys
import time


def fla_available() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def warm_shapes(plan, limit: int = 24) -> list[tuple[int, int]]:
    """(rows, padded_length) of up to ``limit`` batches spread over the plan, longest and shortest included."""
    shapes = sorted({(b.rows, b.padded_length) for b in plan.batches}, key=lambda s: -s[1])
    if len(shapes) <= limit:
        return shapes
    step = (len(shapes) - 1) / (limit - 1)
    return [shapes[round(i * step)] for i in range(limit)]


def main(argv=None) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hsextract.config import RunConfig
    from hsextract.model import qwen3_5 as kernels
    from hsextract.model.layers import layer_types
    from hsextract.model.load import base_model
    from hsextract.prepare.plan import Plan
    from hsextract.run.rundir import RunDir

    argv = sys.argv[1:] if argv is None else argv
    run_dir = RunDir(argv[0])
    cfg = RunConfig.load(run_dir.config_file)
    plan = Plan.load(run_dir.plan_file)
    text = AutoConfig.from_pretrained(cfg.model).get_text_config()
    types = layer_types(text)
    depth = next((i + 1 for i in range(len(types)) if set(types[: i + 1]) == set(types)), len(types))
    text.num_hidden_layers = depth
    if getattr(text, "layer_types", None):
        text.layer_types = types[:depth]
    text._attn_implementation = cfg.attn_implementation
    t0 = time.time()
    with torch.device("cuda"):
        lm = AutoModelForCausalLM.from_config(text, dtype=getattr(torch, cfg.dtype))
    lm.eval()
    kernels.apply(lm, cfg.kernel_mode)  # compile the kernels the shards will run
    decoder = base_model(lm)
    shapes = warm_shapes(plan)
    with torch.inference_mode():
        for rows, length in shapes:
            ids = torch.randint(0, text.vocab_size, (rows, length), device="cuda")
            mask = torch.ones_like(ids)
            mask[1:, length // 2 :] = 0  # padded rows, as in real batches
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    torch.cuda.synchronize()
    print(
        json.dumps(
            {
                "warmup_s": time.time() - t0,
                "shapes": len(shapes),
                "layers": depth,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
