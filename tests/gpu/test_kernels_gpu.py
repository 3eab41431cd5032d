"""The fused kernels (hsextract.model.qwen3_5) against transformers' stock forward on the real Qwen3.6-27B layer shapes.

Random weights of the real shapes (4 layers: 3 Gated-DeltaNet + 1 full attention), norm weights, decays and gates
randomised too so that every scaling path matters, and padded batches of ragged rows. The reference is a float32
forward of the same weights (a float32 copy of the bf16 model) with TF32 off and transformers' pure-torch
Gated-DeltaNet, so it is exact float32 throughout. For each swapped module alone and for each layer of a whole
forward, on the valid tokens: the fused bf16 result must be at least as close to the reference as the stock bf16
result, up to ``MARGIN`` (5%): where a fused kernel does the same arithmetic as stock in another order (the norms,
SiLU-and-multiply, the GEMMs), the two errors differ only by rounding noise. Skipped without CUDA.
"""

import copy

import pytest
import torch
from support.exact import exact_float32

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MARGIN = 1.05
RIGHT = [700, 1, 64, 333, 5, 128, 1030, 257]  # ragged rows, right-padded to 1030


def _randomise(lm):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for mod in lm.modules():
            if isinstance(mod, m.Qwen3_5RMSNorm):
                mod.weight.copy_(0.1 * torch.randn(mod.weight.shape, generator=g))
            elif isinstance(mod, m.Qwen3_5RMSNormGated):
                mod.weight.copy_(1 + 0.1 * torch.randn(mod.weight.shape, generator=g))
            elif isinstance(mod, m.Qwen3_5GatedDeltaNet):
                mod.dt_bias.copy_(torch.randn(mod.dt_bias.shape, generator=g))


@pytest.fixture(scope="module")
def models():
    """(bf16 model, float32 copy of the same weights), 4 layers of the Qwen3.6-27B shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained("configs/qwen3.6-27b")
    cfg.num_hidden_layers = 4
    cfg.layer_types = cfg.layer_types[:4]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm16 = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    _randomise(lm16)
    lm32 = copy.deepcopy(lm16).float().eval()
    return lm16, lm32


def batch(lengths, left=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, 240000, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        if left:
            mask[r, width - n :] = 1
        else:
            mask[r, :n] = 1
    return ids.cuda(), mask.cuda()


def rel(got, want, valid):
    got, want = got[valid].float(), want[valid].float()
    return ((got - want).norm() / want.norm()).item()


def layer_outputs(lm, ids, mask):
    """Every decoder layer's output (the states hsextract captures), from forward hooks."""
    from hsextract.model.load import base_model, decoder_layers

    outs = {}
    handles = [
        layer.register_forward_hook(
            lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o)
        )
        for i, layer in enumerate(decoder_layers(lm))
    ]
    try:
        with torch.inference_mode():
            base_model(lm)(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [outs[i] for i in range(len(outs))]


def test_apply_swaps_every_kernel_on_the_real_shape_and_restore_undoes_it(models):
    from hsextract.model import qwen3_5 as kernels

    lm16, _ = models
    try:
        assert kernels.apply(lm16) == list(kernels.SWAPS)
        assert kernels.swapped(lm16) == list(kernels.SWAPS)
    finally:
        kernels.restore(lm16)
    assert kernels.swapped(lm16) == []
    assert kernels.apply(lm16, "stock") == []


def test_right_padding_mask_is_dropped_and_any_other_mask_kept(models):
    from hsextract.model import qwen3_5 as kernels
    from hsextract.model.load import decoder_layers

    lm16, _ = models
    seen = []
    h = decoder_layers(lm16)[0].register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True
    )
    kernels.apply(lm16)
    try:
        for left in (False, True):
            ids, mask = batch([40, 7, 19], left=left)
            with torch.inference_mode():
                lm16.model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        kernels.restore(lm16)
        h.remove()
    assert seen[0] is None and seen[1] is not None


def _module_cases(lm):
    from hsextract.model.load import decoder_layers

    layers = decoder_layers(lm)
    gdn, attn = layers[0], layers[3]
    return {
        "rms_norm (input_layernorm)": gdn.input_layernorm,
        "silu_mul (MLP)": gdn.mlp,
        "gated_rms_norm": gdn.linear_attn.norm,
        "Gated-DeltaNet mixer (conv + GVA rule + gated norm)": gdn.linear_attn,
        "attention mixer (qk norm + rope + sdpa + gate)": attn.self_attn,
        "Gated-DeltaNet decoder layer": gdn,
        "attention decoder layer": attn,
    }


def _capture_inputs(lm, modules, ids, mask):
    """The (args, kwargs) each module gets in a stock forward of the padded batch."""
    from hsextract.model.load import base_model

    got = {}
    handles = [
        mod.register_forward_pre_hook(
            lambda m, a, kw, n=name: got.setdefault(n, (a, dict(kw))), with_kwargs=True
        )
        for name, mod in modules.items()
    ]
    try:
        with torch.inference_mode():
            base_model(lm)(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


def _to(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, tuple):
        return tuple(_to(y, dtype) for y in x)
    return x


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_each_swapped_module_alone_is_at_least_as_close_to_float32_as_stock(models):
    from hsextract.model import qwen3_5 as kernels

    lm16, lm32 = models
    ids, mask = batch(RIGHT)
    valid = mask.bool()
    mods16, mods32 = _module_cases(lm16), _module_cases(lm32)
    inputs = _capture_inputs(lm16, mods16, ids, mask)
    rows, failures = [], []
    for name, mod16 in mods16.items():
        args, kw = inputs[name]
        with torch.inference_mode():
            with exact_float32():
                ref = _first(
                    mods32[name](
                        *_to(args, torch.float32), **{k: _to(v, torch.float32) for k, v in kw.items()}
                    )
                )
            stock = _first(mod16(*args, **kw))
            kernels.apply(lm16)
            try:
                fused_masked = _first(
                    mod16(*args, **kw)
                )  # the mask kept (left-padded batches take this path)
                unmasked = {k: (None if k == "attention_mask" else v) for k, v in kw.items()}
                fused = _first(mod16(*args, **unmasked))  # what the right-padding hook hands it
            finally:
                kernels.restore(lm16)
        v = valid if ref.dim() == 3 else valid.flatten().repeat_interleave(ref.shape[0] // valid.numel())
        e_stock, e_fused, e_masked = rel(stock, ref, v), rel(fused, ref, v), rel(fused_masked, ref, v)
        rows.append(f"| {name} | {e_stock:.3e} | {e_fused:.3e} | {e_masked:.3e} | {e_fused / e_stock:.3f} |")
        if not (e_fused <= MARGIN * e_stock and e_masked <= MARGIN * e_stock):
            failures.append(name)
    print("\n| module alone, bf16 vs float32 | stock | fused | fused, mask kept | fused / stock |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    assert not failures, failures


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_whole_forward_each_layer_is_at_least_as_close_to_float32_as_stock(models, left):
    from hsextract.model import qwen3_5 as kernels

    lm16, lm32 = models
    ids, mask = batch(RIGHT, left=left, seed=2)
    valid = mask.bool()
    with exact_float32():
        ref = layer_outputs(lm32, ids, mask)
    stock = layer_outputs(lm16, ids, mask)
    kernels.apply(lm16)
    try:
        fused = layer_outputs(lm16, ids, mask)
    finally:
        kernels.restore(lm16)
    print(f"\n| layer ({'left' if left else 'right'}-padded) | stock vs float32 | fused vs float32 | ratio |")
    print("|---|---|---|---|")
    bad = []
    for k, (s, f, r) in enumerate(zip(stock, fused, ref, strict=True)):
        assert torch.isfinite(f[valid]).all()
        e_s, e_f = rel(s, r, valid), rel(f, r, valid)
        print(f"| {k} | {e_s:.3e} | {e_f:.3e} | {e_f / e_s:.3f} |")
        if e_f > MARGIN * e_s:
            bad.append(k)
    assert not bad, bad
