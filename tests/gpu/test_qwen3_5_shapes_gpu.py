"""The fused kernels (model/qwen3_5.py) on every shipped ``qwen3_5`` config shape (tests/support/shapes.py, with the
real head dims the kernels compile for) against a float32 forward of the checkpoint's own model on the CPU."""

import pytest
import torch
from support.batch import padded
from support.shapes import SHAPES, build

from hsextract.model import qwen3_5 as kernels
from hsextract.model.capture import GatherTarget, LayerCapture
from hsextract.model.load import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fused_kernels_on_each_shipped_shape_equal_a_float32_forward(name, tmp_path):
    reference, path = build(name, tmp_path / name, real_head_dims=True)
    lm = load_model(str(path), dtype="bfloat16", device="cuda")
    assert kernels.apply(lm, "fused") == list(kernels.SWAPS)
    hidden = lm.config.get_text_config().hidden_size
    torch.manual_seed(1)
    seqs = [torch.randint(1, 300, (n,)) for n in (300, 1, 64, 129)]
    ids, mask, flat = padded(seqs, "cuda")
    layer_ids = (0, 3, 6)
    out = torch.full((len(flat), len(layer_ids), hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    with LayerCapture(lm, layer_ids) as cap, torch.inference_mode():
        cap.forward(ids, mask, GatherTarget(flat, out))
    off, worst = 0, 0.0
    for s in seqs:
        with torch.inference_mode():
            ref = reference.model.language_model(s[None], output_hidden_states=True).hidden_states
        for j, k in enumerate(layer_ids):
            got, want = out[off : off + len(s), j].float().cpu(), ref[k + 1][0]
            rel = ((got - want).norm() / want.norm()).item()
            worst = max(worst, rel)
            assert rel < 2e-2, (name, k, len(s), rel)
            neighbour = ((got - ref[k][0]).norm() / want.norm()).item()
            assert neighbour > 5 * rel, (name, k, len(s), rel, neighbour)
        off += len(s)
    print(f"{name}: worst relative error of the fused bf16 capture vs float32: {worst:.2e}")
