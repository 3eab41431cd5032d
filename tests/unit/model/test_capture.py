"""Layer ids and the capture (layers.py, model/capture.py, model/load.py): presets, bad ids, hooks against an
unbatched HF forward, early exit, fp8 on the device, multimodal and other causal LM checkpoints."""

import pytest
import torch
from support.batch import padded
from support.faults import ShiftedCapture

from hsextract.errors import HsextractError
from hsextract.layers import (
    dflash2_layer_ids,
    dflash_layer_ids,
    eagle3_layer_ids,
    implies_final_state,
    presets_layer_ids,
    resolve_layer_ids,
)
from hsextract.model.capture import GatherTarget, LayerCapture
from hsextract.model.load import load_model, load_model_config


def test_presets_match_published_defaults_for_64_layers():
    assert dflash_layer_ids(64) == (1, 16, 31, 46, 61)
    assert eagle3_layer_ids(64) == (1, 31, 60)
    assert resolve_layer_ids("dflash", 64) == (1, 16, 31, 46, 61)
    assert resolve_layer_ids("1, 16,31", 64) == (1, 16, 31)


def test_dflash2_ids_match_every_published_drafter_config():
    assert dflash2_layer_ids(64) == (5, 19, 33, 47, 61)  # z-lab/Qwen3.8-27B-DFlash2
    assert dflash2_layer_ids(52) == (1, 13, 25, 37, 49)  # z-lab/dflash tests/fixtures/dflash2-config.json
    assert dflash2_layer_ids(36) == (1, 9, 17, 25, 33)  # NeMo Automodel qwen3_dflash2.yaml (Qwen3-8B)
    assert dflash2_layer_ids(8) == dflash_layer_ids(8)  # too shallow for the spacing: DFlash's rule


def test_union_of_presets_captures_each_id_once_and_records_each_preset():
    spec = "DFlash, dflash2,eagle3,dflash"
    assert resolve_layer_ids(spec, 64) == (1, 5, 16, 19, 31, 33, 46, 47, 60, 61)
    assert presets_layer_ids(spec, 64) == {
        "dflash": [1, 16, 31, 46, 61],
        "dflash2": [5, 19, 33, 47, 61],
        "eagle3": [1, 31, 60],
    }
    assert presets_layer_ids("1,2", 64) == {}
    assert implies_final_state("dflash,dspark") and implies_final_state("eagle3")
    assert not implies_final_state("dflash,dflash2") and not implies_final_state((1, 2))


@pytest.mark.parametrize(
    "spec, match",
    [
        ("0,64", r"out of range.*ids 0\.\.63.*output_hidden_states\[k\+1\]"),
        ("3,3", "repeats"),
        ("a,b", "preset"),
        ("", "empty"),
        ("-1", "out of range"),
        ("dflash,3", "mixes presets and layer ids"),
        ("dflash,eagle", "neither presets"),
    ],
)
def test_bad_layer_ids_get_a_clear_error(spec, match):
    with pytest.raises(HsextractError, match=match):
        resolve_layer_ids(spec, 64)


def test_missing_model_path_fails_before_loading(tmp_path):
    with pytest.raises(HsextractError, match="no such directory"):
        load_model_config(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HsextractError, match="no config.json"):
        load_model_config(str(tmp_path / "empty"))


def _capture(lm, seqs, layer_ids, capture=LayerCapture):
    ids, mask, flat = padded(seqs)
    hidden = lm.config.get_text_config().hidden_size
    out = torch.full((len(flat), len(layer_ids), hidden), float("nan"))
    with capture(lm, layer_ids) as cap, torch.inference_mode():
        cap.forward(ids, mask, GatherTarget(flat, out))
    return out


def _reference(lm, seq):
    with torch.inference_mode():
        return lm(seq[None], output_hidden_states=True).hidden_states


def test_hooked_padded_batch_equals_unbatched_hf_forward(tiny_lm):
    torch.manual_seed(1)
    lengths = [61, 1, 17, 40, 2, 33]
    seqs = [torch.randint(1, 500, (n,)) for n in lengths]
    layer_ids = (0, 3, 6)  # first, a full-attention layer, and the deepest but one
    out = _capture(tiny_lm, seqs, layer_ids)
    off = 0
    for s in seqs:
        ref = _reference(tiny_lm, s)
        for j, k in enumerate(layer_ids):
            torch.testing.assert_close(out[off : off + len(s), j], ref[k + 1][0], rtol=1e-4, atol=1e-4)
        off += len(s)


def test_last_layer_is_captured_before_the_final_norm(tiny_lm):
    seq = torch.randint(1, 500, (20,))
    last = tiny_lm.config.num_hidden_layers - 1
    out = _capture(tiny_lm, [seq], (last,))[:, 0]
    ref = _reference(tiny_lm, seq)
    assert not torch.allclose(out, ref[last + 1][0], atol=1e-3)  # HF's last entry is normed
    torch.testing.assert_close(tiny_lm.model.norm(out), ref[last + 1][0], rtol=1e-4, atol=1e-4)


def test_forward_stops_after_the_deepest_wanted_layer(tiny_lm):
    ran = []
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
        for i, layer in enumerate(tiny_lm.model.layers)
    ]
    try:
        _capture(tiny_lm, [torch.randint(1, 500, (9,))], (1, 3))
    finally:
        for h in handles:
            h.remove()
    assert ran == [0, 1, 2, 3]


def test_a_capture_shifted_by_one_layer_differs_beyond_tolerance(tiny_lm):
    """The tiny model's layers must differ enough that an off-by-one is visible (guards the test above)."""
    seq = torch.randint(1, 500, (30,))
    good = _capture(tiny_lm, [seq], (2,))
    shifted = _capture(tiny_lm, [seq], (2,), capture=ShiftedCapture)
    assert (good - shifted).norm() / good.norm() > 0.1


def test_multimodal_checkpoint_loads_only_the_language_model(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from hsextract.demo import tiny_qwen3_5_config

    text = tiny_qwen3_5_config(300, 4)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision))
    full.save_pretrained(tmp_path / "mm")
    _, _, num_layers = load_model_config(str(tmp_path / "mm"))
    assert num_layers == 4
    lm = load_model(str(tmp_path / "mm"), dtype="float32", device="cpu")
    assert not any("visual" in n for n, _ in lm.named_parameters())
    seq = torch.randint(1, 300, (15,))
    out = _capture(lm, [seq], (1, 2))
    with torch.inference_mode():
        ref = full.model.language_model(seq[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(out[:, 0], ref[2][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:, 1], ref[3][0], rtol=1e-4, atol=1e-4)


def test_any_causal_lm_works_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    lm = load_model(str(tmp_path / "llama"), dtype="float32", device="cpu")
    seqs = [torch.randint(1, 300, (n,)) for n in (12, 3, 7)]
    out = _capture(lm, seqs, (0, 2))
    off = 0
    for s in seqs:
        ref = _reference(lm, s)
        torch.testing.assert_close(out[off : off + len(s), 0], ref[1][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[off : off + len(s), 1], ref[3][0], rtol=1e-4, atol=1e-4)
        off += len(s)


def test_fp8_capture_quantizes_each_gathered_vector_on_the_device(tiny_lm):
    from hsextract.output.fp8 import FP8, quantize_fp8

    torch.manual_seed(2)
    seqs = [torch.randint(1, 500, (n,)) for n in (23, 4, 11)]
    plain = _capture(tiny_lm, seqs, (1, 7))
    ids, mask, flat = padded(seqs)
    out = torch.empty(len(flat), 2, 64, dtype=FP8)
    scale = torch.empty(len(flat), 2)
    with LayerCapture(tiny_lm, (1, 7)) as cap, torch.inference_mode():
        cap.forward(ids, mask, GatherTarget(flat, out, scale))
    q, s = quantize_fp8(plain)
    assert torch.equal(out.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale, s)
