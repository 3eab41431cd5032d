"""fp8 quantization with a scale per vector, and the final norm derived from the model's own norm module."""

import pytest
import torch

from hsextract.errors import HsextractError
from hsextract.model.capture import probe_final_norm
from hsextract.output.fp8 import FP8, dequantize_fp8, quantization_error, quantize_fp8


def test_fp8_round_trip_keeps_each_vector_within_its_own_scale():
    torch.manual_seed(0)
    # Vectors of very different norms, as the layers of one token are: each keeps ~2.6% relative error.
    x = torch.randn(64, 3, 256) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    q, s = quantize_fp8(x.to(torch.bfloat16))
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (64, 3)
    torch.testing.assert_close(s, x.to(torch.bfloat16).float().abs().amax(-1) / 448)
    back = dequantize_fp8(q, s, torch.float32)
    for j in range(3):
        rel = (back[:, j] - x[:, j]).norm() / x[:, j].norm()
        assert rel < 0.035
    assert dequantize_fp8(q, s).dtype == torch.bfloat16


def test_fp8_zero_vectors_stay_zero_and_nan_stays_visible():
    x = torch.randn(4, 32)
    x[1] = 0
    x[2, 5] = float("nan")
    q, s = quantize_fp8(x)
    back = dequantize_fp8(q, s, torch.float32)
    assert s[1] == 0 and torch.equal(back[1], torch.zeros(32))
    assert not torch.isfinite(back[2]).all()
    assert torch.isfinite(back[[0, 3]]).all()


def test_quantization_error_figures():
    torch.manual_seed(0)
    e = quantization_error(torch.randn(512, 1024))
    assert 0.015 < e["rel_l2"] < 0.035
    assert 0.999 < e["cos_min"] <= e["cos_mean"] < 1


def test_final_norm_rule_is_read_from_qwen3_5_and_llama_norms():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    torch.manual_seed(0)
    for cls, rule in ((Qwen3_5RMSNorm, "one_plus_weight"), (LlamaRMSNorm, "weight")):
        for dtype in (torch.float32, torch.bfloat16):
            norm = cls(64, eps=1e-5)
            with torch.no_grad():
                norm.weight.normal_(0, 0.5)
            norm = norm.to(dtype)
            fn = probe_final_norm(norm)
            assert fn.rule == rule and fn.eps == 1e-5 and fn.weight.dtype == dtype
            x = (torch.randn(7, 64) * 4).to(dtype)
            with torch.no_grad():
                torch.testing.assert_close(fn(x), norm(x), rtol=0, atol=0)


def test_final_norm_refuses_a_layernorm_with_bias():
    with pytest.raises(HsextractError, match="not an RMSNorm"):
        probe_final_norm(torch.nn.LayerNorm(16))


def test_final_state_and_storage_dtype_come_from_yaml_and_the_eagle3_preset(tmp_path):
    from hsextract.config import RunConfig, load_yaml

    paths = {"model": "m", "data": "d", "output": "o", "run_dir": "r"}
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("layers: 1,16,31\nfinal-state: true\nstorage_dtype: float8_e4m3fn\n")
    cfg = RunConfig(**paths, **load_yaml(yaml_file))
    assert cfg.wants_final_state and cfg.storage_dtype == "float8_e4m3fn"
    assert RunConfig(**paths, layers="eagle3").wants_final_state
    assert not RunConfig(**paths, layers="dflash").wants_final_state
    with pytest.raises(HsextractError, match="--storage-dtype 'int4' is not one of float8_e4m3fn"):
        RunConfig(**paths, storage_dtype="int4")


def test_state_layout_slots_and_bytes():
    from hsextract.output import StateLayout

    dflash = StateLayout((1, 16, 31, 46, 61), 64, final_state=True)
    assert dflash.slot_layers == (1, 16, 31, 46, 61, 63) and dflash.final_slot == 5
    shared = StateLayout((0, 3, 7), 8, final_state=True)
    assert shared.slot_layers == (0, 3, 7) and shared.final_slot == 2
    assert StateLayout((1, 2), 8).final_slot is None
    # 5 layers of 5120: 51.2 KB a token in bfloat16, ~25.7 KB in fp8 with a float32 scale per layer.
    assert StateLayout((1, 16, 31, 46, 61), 64).bytes_per_token(5120, 2) == 5 * 5120 * 2 + 5
    fp8 = StateLayout((1, 16, 31, 46, 61), 64, storage_dtype="float8_e4m3fn")
    assert fp8.bytes_per_token(5120, 2) == 5 * (5120 + 4) + 5
