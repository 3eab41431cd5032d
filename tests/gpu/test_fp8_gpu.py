"""fp8 compute on a Hopper GPU: each quantizing kernel against the recipe in torch, the block-scaled GEMM against a
float32 product of the dequantized operands, and the fused fp8 forward's states per layer against the independent
recipe forward and its wrong variants (tests/support/fp8ref.py). Skipped without CUDA."""

import json

import pytest
import torch

from hsextract.model import fp8
from hsextract.model import fp8_kernels as fk

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (block-scaled fp8 GEMMs)",
)


def _same_quantization(name, got, x_ref):
    """``got`` (q, scale) against the recipe applied in torch to the float32 ``x_ref`` [M, K]: scales to float32
    rounding, values differing only where float32 arithmetic order moved a rounding (a few in 10^4)."""
    q, s = got
    assert s.stride() == (1, s.shape[0]) and len(q) == len(s) and len(q) % 16 == 0, (
        name,
        s.shape,
        s.stride(),
    )
    assert not q[len(x_ref) :].float().any() and not s[len(x_ref) :].any()  # padding rows: zero
    q, s = q[: len(x_ref)], s[: len(x_ref)]
    rq, rs = fp8.quantize_activation(x_ref)
    assert torch.allclose(s, rs, rtol=1e-5, atol=0), (name, (s - rs).abs().max().item())
    flips = (q.float() != rq.float()).float().mean().item()
    print(
        f"{name}: scale max rel diff {((s - rs).abs() / rs.clamp_min(1e-30)).max().item():.1e}, flips {flips:.1e}"
    )
    assert flips < 2e-3, (name, flips)


def test_quantizing_kernels_follow_the_recipe():
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    M, K, inner = 1000, 5120, 1408
    x = torch.randn(M, K, generator=g, **dev) * torch.rand(M, 1, generator=g, **dev) * 4
    x[3] = 0
    _same_quantization("quantize_rows", fk.quantize_rows(x), x.float())
    w = torch.randn(K, generator=g, device="cuda") * 0.1
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    _same_quantization("rms_norm_quant", fk.rms_norm_quant(x, w, 1e-6), normed)
    r = torch.randn(M, K, generator=g, **dev)
    q, s, total, out = fk.rms_norm_quant(x, w, 1e-6, residual=r, normed=True)
    assert torch.equal(total, x + r)
    tf = total.float()
    normed = tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    _same_quantization("add + rms_norm_quant", (q, s), normed)
    assert torch.allclose(out.float(), normed, rtol=1e-2, atol=1e-2)
    gu = torch.randn(M, 2 * inner, generator=g, **dev)
    a, b = gu.float().chunk(2, -1)
    _same_quantization("silu_mul_quant", fk.silu_mul_quant(gu), torch.nn.functional.silu(a) * b)
    B, T, H, D = 2, 300, 3, 256
    attn = torch.randn(B, H, T, D, generator=g, **dev).transpose(1, 2)
    gate = torch.randn(B, T, H, 2 * D, generator=g, **dev)[..., D:]
    ref = (attn.float() * torch.sigmoid(gate.float())).reshape(B * T, H * D)
    _same_quantization("sigmoid_gate_quant", fk.sigmoid_gate_quant(attn, gate), ref)
    D = 128
    o = torch.randn(B, T, H, D, generator=g, **dev)
    z = torch.randn(B * T, 1024, generator=g, **dev)[:, 256 : 256 + H * D].view(B, T, H, D)
    wn = torch.randn(D, generator=g, device="cuda")
    of = o.float()
    n = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).float()
    ref = (wn * n * torch.nn.functional.silu(z.float())).reshape(B * T, H * D)
    _same_quantization("gated_rms_norm_quant", fk.gated_rms_norm_quant(o, z, wn, 1e-6), ref)


def test_block_scaled_gemm_is_the_product_of_the_dequantized_operands():
    g = torch.Generator(device="cuda").manual_seed(1)
    M, K, N = 777, 5120, 2560  # 777 rows: cuBLASLt refused them unpadded
    x = torch.randn(M, K, generator=g, device="cuda") * torch.rand(M, 1, generator=g, device="cuda")
    w = torch.randn(N, K, generator=g, device="cuda") * torch.rand(N, 1, generator=g, device="cuda") * 0.05
    wq, ws = fp8.quantize_weight(w)
    xq, xs = fk.quantize_rows(x.to(torch.bfloat16))
    out = fp8.block_scaled_mm(xq, xs, wq, ws, torch.bfloat16).float()[:M]
    ref = fp8.dequantize_activation(xq[:M], xs[:M]).double() @ fp8.dequantize_weight(wq, ws).double().t()
    err = ((out - ref).norm() / ref.norm()).item()
    print(f"block-scaled GEMM vs float64 product of the dequantized operands: {err:.2e}")
    assert err < 5e-3
    lin = fp8.Fp8Linear(wq, ws)
    assert lin.gemm_ready
    assert torch.equal(lin(x.to(torch.bfloat16)).float(), out)


def test_fused_fp8_forward_is_nearer_the_recipe_than_every_wrong_variant(tmp_path):
    from support.exact import exact_float32
    from support.fp8ref import LAYERS, VARIANTS, distances, reference_states, write_checkpoints

    from hsextract.model import qwen3_5 as kernels
    from hsextract.model.load import load_model

    bf16_dir, fp8_dir = write_checkpoints(tmp_path, wide=True)
    g = torch.Generator().manual_seed(3)
    samples = {
        f"s{i}": torch.randint(1, 200, (n,), generator=g).tolist() for i, n in enumerate((37, 129, 300))
    }
    with exact_float32():  # transformers' Gated-DeltaNet in torch: FLA's kernels take no CPU tensors
        refs = {
            dt: reference_states(bf16_dir, fp8_dir, samples, getattr(torch, dt))
            for dt in ("bfloat16", "float32")
        }
    lm = load_model(str(fp8_dir), dtype="bfloat16", device="cuda")
    assert lm.hsx_compute == "fp8"
    runs = {}
    for mode in ("fused", "stock"):
        swapped = kernels.apply(lm, mode)
        if mode == "fused":
            assert "residual_add_rms_norm" in swapped
            assert lm.model.layers[0].forward.__func__.__module__.endswith("qwen3_5_fp8")
        captured, out = {}, {}
        hooks = [
            lm.model.layers[k].register_forward_hook(
                lambda m, a, o, k=k, c=captured: c.__setitem__(k, o if torch.is_tensor(o) else o[0])
            )
            for k in LAYERS
        ]
        with torch.inference_mode():
            for sid, ids in samples.items():
                lm(torch.tensor([ids], device="cuda"), use_cache=False)
                out[sid] = {"layers": {k: captured[k][0].float().cpu() for k in LAYERS}}
        for h in hooks:
            h.remove()
        runs[mode] = out
    kernels.restore(lm)
    report = {
        f"{mode} vs {dt} references": distances(runs[mode], refs[dt], samples) for mode in runs for dt in refs
    }
    print(json.dumps(report, indent=1))
    # The fused kernels quantize from float32 (the norms', SiLU's and gates' own results), so the float32 recipe is
    # the one to be nearest; bf16 inputs elsewhere flip fp8 roundings, which keeps the unquantized variant nearest
    # of the wrong ones (0.61-0.74 of its distance on 2026-12-04, the others 0.56 or less).
    for k, dist in report["fused vs float32 references"].items():
        for variant in VARIANTS[1:]:
            bound = 0.8 if variant == "activations not quantized" else 0.6
            assert dist["recipe"] < bound * dist[variant], (k, variant, dist)


def test_block_scaled_gemm_row_counts():
    """Which row counts cuBLASLt's block-scaled GEMM takes unpadded (printed), and that every count runs padded."""
    g = torch.Generator(device="cuda").manual_seed(2)
    K, N = 5120, 1024
    wq, ws = fp8.quantize_weight(torch.randn(N, K, generator=g, device="cuda"))
    seen = {}
    for M in (1, 2, 4, 8, 15, 16, 777, 780, 784, 1000, 1024):
        x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
        rq, rs = fp8.quantize_activation(x)
        try:
            fp8.block_scaled_mm(rq.contiguous(), rs.t().contiguous().t(), wq, ws, torch.bfloat16)
            seen[M] = "ok"
        except RuntimeError as e:
            seen[M] = str(e).split(" when ")[0][-40:]
        lin = fp8.Fp8Linear(wq, ws)
        assert lin(x).shape == (M, N)
    print("unpadded block-scaled GEMM by row count:", seen)
    shapes = {}
    x = torch.randn(64, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    for N, K in (
        (128, 512),
        (256, 512),
        (384, 512),
        (640, 512),
        (512, 128),
        (512, 256),
        (512, 384),
        (512, 640),
    ):
        wq, ws = fp8.quantize_weight(torch.randn(N, K, generator=g, device="cuda"))
        rq, rs = fk.quantize_rows(x[:, :K])
        try:
            fp8.block_scaled_mm(rq, rs, wq, ws, torch.bfloat16)
            shapes[(N, K)] = "ok"
        except RuntimeError as e:
            shapes[(N, K)] = str(e).split(" when ")[0][-28:]
    print("block-scaled GEMM by weight shape (N, K):", shapes)


def test_dry_run_proves_the_fused_fp8_compute_on_the_gpu(tmp_path):
    """The dry run's fp8 proof on the path a GPU run takes (bf16 activations, the fused fp8 layer): every layer
    nearest the served recipe, the weights and scales identical to the checkpoint's files."""
    from support.fp8ref import dry_run_config, write_checkpoints

    from hsextract.dryrun import dry_run, format_report
    from hsextract.model import qwen3_5 as kernels
    from hsextract.model.load import load_model

    _, fp8_dir = write_checkpoints(tmp_path, wide=True)
    cfg = dry_run_config(
        fp8_dir, tmp_path, (40, 129, 300, 64), device="cuda", dtype="bfloat16", kernels="fused"
    )
    lm = load_model(str(fp8_dir), dtype="bfloat16", device="cuda")
    assert "residual_add_rms_norm" in kernels.apply(lm, "fused")
    assert lm.model.layers[0].forward.__func__.__module__.endswith("qwen3_5_fp8")
    result = dry_run(cfg, num_samples=4, lm=lm)
    check = result.report["fp8_check"]
    text = format_report(result.report)
    print(text)
    assert result.ok and check["ok"], text
    assert check["checked_against_files"] and not check["mismatched_linears"]
    for layer, dist in check["layers"].items():
        assert all(dist["recipe"] < d for v, d in dist.items() if v != "recipe"), (layer, dist)
