"""Every shipped ``qwen3_5`` config shape (tests/support/shapes.py) through hsextract's loader and capture equals an
unbatched forward of the model the checkpoint was written from; shapes the fused kernels cannot run are refused
with a message. The fused kernels on the same shapes: tests/gpu/test_qwen3_5_shapes_gpu.py."""

import types

import pytest
import torch
from support.batch import padded
from support.shapes import SHAPES, build, text_config

from hsextract.errors import HsextractError
from hsextract.layers import layer_types
from hsextract.model import qwen3_5 as kernels
from hsextract.model.capture import GatherTarget, LayerCapture
from hsextract.model.load import load_model, load_model_config


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_shipped_shape_captures_what_an_unbatched_forward_of_its_checkpoint_gives(name, tmp_path):
    reference, path = build(name, tmp_path / name)
    _, text, num_layers = load_model_config(str(path))
    assert num_layers == 8 and kernels.claims(text) and kernels.unsupported(text) == []
    assert layer_types(text).count("full_attention") == 2
    assert text.rope_parameters["rope_type"] == ("yarn" if "yarn" in SHAPES[name] else "default")
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert not any(n.startswith(("mtp", "model.visual")) for n, _ in lm.named_parameters())
    if text.tie_word_embeddings:
        assert lm.get_output_embeddings().weight.data_ptr() == lm.get_input_embeddings().weight.data_ptr()
    torch.manual_seed(1)
    seqs = [torch.randint(1, 300, (n,)) for n in (37, 1, 12, 25)]
    ids, mask, flat = padded(seqs)
    layer_ids = (0, 3, 6)  # a Gated-DeltaNet layer, the first full attention, the deepest but one
    out = torch.full((len(flat), len(layer_ids), text.hidden_size), float("nan"))
    with LayerCapture(lm, layer_ids) as cap, torch.inference_mode():
        cap.forward(ids, mask, GatherTarget(flat, out))
    off = 0
    for s in seqs:
        with torch.inference_mode():
            ref = reference.model.language_model(s[None], output_hidden_states=True).hidden_states
        for j, k in enumerate(layer_ids):
            torch.testing.assert_close(out[off : off + len(s), j], ref[k + 1][0], rtol=1e-4, atol=1e-4)
        off += len(s)


def test_the_real_shapes_are_ones_the_fused_kernels_run():
    for name in SHAPES:
        cfg = types.SimpleNamespace(**text_config(name, real_head_dims=True))
        assert kernels.unsupported(cfg) == [], name
    assert kernels.check_shape(types.SimpleNamespace(model_type="llama")) is None  # not claimed: not checked


def test_a_shape_the_fused_kernels_cannot_run_is_refused_with_each_reason():
    cfg = dict(text_config("qwen3.6-27b", real_head_dims=True))
    cfg.update(head_dim=80, num_attention_heads=6, num_key_value_heads=4, linear_key_head_dim=512)
    cfg.update(linear_num_value_heads=5)
    problems = kernels.unsupported(types.SimpleNamespace(**cfg))
    assert len(problems) == 4 and "head_dim 80" in problems[0]
    with pytest.raises(HsextractError, match=r"head_dim 80 .*linear_key_head_dim 512 .*--kernels stock"):
        kernels.check_shape(types.SimpleNamespace(**cfg))
    odd = dict(text_config("qwen3.6-27b"), rope_parameters={"partial_rotary_factor": 0.3})
    assert "rotary dims 9" in kernels.unsupported(types.SimpleNamespace(**odd))[0]


def test_preparation_refuses_such_a_shape_on_cuda_before_any_work(tmp_path):
    from transformers import Qwen3_5TextConfig

    from hsextract.config import RunConfig
    from hsextract.run.preflight import check_model_and_output

    fields = {k: v for k, v in text_config("qwen3.6-27b", real_head_dims=True).items() if k != "model_type"}
    Qwen3_5TextConfig(**{**fields, "head_dim": 80}).save_pretrained(tmp_path / "m")
    args = dict(model=str(tmp_path / "m"), data="d", output=str(tmp_path / "o"), run_dir=str(tmp_path / "r"))
    with pytest.raises(HsextractError, match="head_dim 80 is not a power of two.*--kernels stock"):
        check_model_and_output(RunConfig(**args, device="cuda"))
    for ok in (RunConfig(**args, device="cuda", kernels="stock"), RunConfig(**args, device="cpu")):
        assert check_model_and_output(ok).num_layers == 8  # the stock forward runs any head_dim
