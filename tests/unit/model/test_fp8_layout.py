"""Which linears are fp8 is read from the weights' own dtypes: a 1-byte weight without its scale, scales the config
does not announce, or a config that says fp8 over no scales stop the run before any work, naming the tensor
(model/checkpoint.py's ``fp8_layout_problem``, from safetensors headers alone)."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from hsextract.cli import main
from hsextract.model.checkpoint import fp8_layout_problem

pytestmark = pytest.mark.usefixtures("restored_process_state")

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
UP = "model.layers.0.mlp.up_proj"


def _checkpoint(root, tensors, quantization_config=FP8_CONFIG):
    root.mkdir(exist_ok=True)
    config = {"model_type": "qwen3_5_text", "num_hidden_layers": 1}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def _served():
    """One served fp8 linear (e4m3 [256, 130], a scale per 128x128 tile), a bf16 one and the embedding."""
    return {
        f"{UP}.weight": torch.zeros(256, 130).to(torch.float8_e4m3fn),
        f"{UP}.weight_scale_inv": torch.ones(2, 2, dtype=torch.bfloat16),
        "model.layers.0.linear_attn.in_proj_a.weight": torch.zeros(4, 130, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(8, 130, dtype=torch.bfloat16),
    }


def test_the_served_layout_and_a_bf16_checkpoint_pass(tmp_path):
    assert fp8_layout_problem(_checkpoint(tmp_path / "fp8", _served())) is None
    bf16 = {"model.embed_tokens.weight": torch.zeros(8, 130, dtype=torch.bfloat16)}
    assert fp8_layout_problem(_checkpoint(tmp_path / "bf16", bf16, quantization_config=None)) is None


def test_a_one_byte_weight_without_its_scale_is_named(tmp_path):
    tensors = _served()
    del tensors[f"{UP}.weight_scale_inv"]
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(130, 256).to(torch.float8_e4m3fn)
    problem = fp8_layout_problem(_checkpoint(tmp_path / "m", tensors))
    assert problem.startswith(
        "model.layers.0.mlp.down_proj.weight (in model.safetensors) is a 1-byte F8_E4M3"
    )
    assert "no model.layers.0.mlp.down_proj.weight_scale_inv" in problem and "(and 1 more)" in problem
    # int8 without a scale is no weight hsextract can compute either
    int8 = {**_served(), "lm_head.weight": torch.zeros(8, 130, dtype=torch.int8)}
    assert fp8_layout_problem(_checkpoint(tmp_path / "i8", int8)).startswith(
        "lm_head.weight (in model.safetensors)"
    )


def test_scales_the_config_does_not_announce_are_refused(tmp_path):
    problem = fp8_layout_problem(_checkpoint(tmp_path / "none", _served(), quantization_config=None))
    assert f"{UP}.weight is an fp8 weight with its scale {UP}.weight_scale_inv" in problem
    assert "config.json has no quantization_config" in problem
    other = fp8_layout_problem(_checkpoint(tmp_path / "gptq", _served(), {"quant_method": "gptq"}))
    assert "a quantization_config of quant_method 'gptq'" in other


def test_a_config_saying_fp8_over_unscaled_weights_is_refused(tmp_path):
    bf16 = {"model.embed_tokens.weight": torch.zeros(8, 130, dtype=torch.bfloat16)}
    assert "says fp8 but no weight file holds an fp8 weight" in fp8_layout_problem(
        _checkpoint(tmp_path / "m", bf16)
    )


def test_a_scale_of_a_bf16_weight_or_of_the_wrong_shape_is_named(tmp_path):
    tensors = {**_served(), f"{UP}.weight": torch.zeros(256, 130, dtype=torch.bfloat16)}
    problem = fp8_layout_problem(_checkpoint(tmp_path / "bf16w", tensors))
    assert problem.startswith(
        f"{UP}.weight_scale_inv (in model.safetensors) scales {UP}.weight, which is BF16"
    )
    tensors = {**_served(), f"{UP}.weight_scale_inv": torch.ones(2, 1, dtype=torch.bfloat16)}
    problem = fp8_layout_problem(_checkpoint(tmp_path / "shape", tensors))
    assert "has shape [2, 1], not one scale per 128x128 tile of its [256, 130] weight ([2, 2])" in problem


def test_dry_run_and_run_refuse_an_unscaled_fp8_weight_before_any_work(tiny_model, tmp_path):
    """The silent case: one linear's e4m3 values without their scale ran 611x off and the dry run called the
    weights identical to the checkpoint's files."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    tensors = load_file(str(model / "model.safetensors"))
    name = next(k for k in sorted(tensors) if k.endswith("mlp.up_proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "text": "hello"}\n')
    for args in (
        ["dry-run", "--model", model, "--data", data, "--device", "cpu", "--dtype", "float32"],
        ["run", "--model", model, "--data", data, "--output", tmp_path / "o", "--device", "cpu"],
    ):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2, result.output
        assert f"{name} (in model.safetensors) is a 1-byte F8_E4M3 weight" in result.stderr, result.stderr
    assert not (tmp_path / "o").exists()
