"""hsextract.model.qwen3_5 where no GPU is needed: the right-padding rule, joined projections, and that CPU models are
left alone."""

import pytest
import torch

from hsextract.errors import HsextractError
from hsextract.model import qwen3_5 as kernels


@pytest.mark.parametrize(
    "rows, right",
    [
        ([[1, 1, 1], [1, 1, 0], [1, 0, 0]], True),
        ([[1, 1, 1], [1, 1, 1]], True),  # no padding at all
        ([[1, 1, 0], [0, 0, 0]], True),  # an empty row is all padding
        ([[0, 1, 1], [1, 1, 1]], False),  # left padding
        ([[1, 0, 1]], False),  # a hole
    ],
)
def test_is_right_padded(rows, right):
    assert kernels.is_right_padded(torch.tensor(rows)) is right
    assert kernels.is_right_padded(torch.tensor(rows, dtype=torch.bool)) is right


def test_padding_hook_drops_only_a_right_padded_2d_mask():
    right = torch.tensor([[1, 1, 0]])
    left = torch.tensor([[0, 1, 1]])
    args, kw = kernels._drop_right_padding_mask(None, (), {"input_ids": 1, "attention_mask": right})
    assert kw == {"input_ids": 1, "attention_mask": None}
    args, kw = kernels._drop_right_padding_mask(None, ("ids", right), {})
    assert args == ("ids", None)
    assert kernels._drop_right_padding_mask(None, (), {"attention_mask": left}) is None
    assert kernels._drop_right_padding_mask(None, (), {"attention_mask": None}) is None
    assert kernels._drop_right_padding_mask(None, (), {"attention_mask": torch.ones(1, 1, 3, 3)}) is None


def test_apply_leaves_a_cpu_model_alone(tiny_lm):
    before = {name: mod.forward for name, mod in tiny_lm.named_modules()}
    assert kernels.apply(tiny_lm, "fused") == []
    assert kernels.apply(tiny_lm, "stock") == []
    assert kernels.swapped(tiny_lm) == []
    assert {name: mod.forward for name, mod in tiny_lm.named_modules()} == before


def test_unknown_mode_is_a_message(tiny_lm):
    with pytest.raises(HsextractError, match="--kernels 'fast'"):
        kernels.apply(tiny_lm, "fast")


def test_two_projections_joined_into_one_gemm_keep_their_weights_and_outputs():
    torch.manual_seed(0)
    owner = torch.nn.Module()
    owner.gate, owner.up = torch.nn.Linear(8, 5, bias=False), torch.nn.Linear(8, 3, bias=False)
    x = torch.randn(2, 4, 8)
    want_gate, want_up = owner.gate(x), owner.up(x)
    joined = kernels.join_weights(owner, owner.gate, owner.up, "_joined")
    owner._joined = joined
    assert joined.shape == (8, 8)
    assert owner.gate.weight.data_ptr() == joined.data_ptr()
    assert owner.up.weight.data_ptr() == joined[5:].data_ptr()
    both = (
        x @ kernels.joined_weight(owner, "_joined", owner.gate).t()
    )  # one GEMM: rounding may differ from two
    torch.testing.assert_close(both[..., :5], want_gate, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(both[..., 5:], want_up, rtol=1e-6, atol=1e-6)
    assert torch.equal(owner.gate(x), want_gate) and torch.equal(owner.up(x), want_up)  # stock path on views
    assert kernels.join_weights(owner, owner.gate, owner.up, "_joined") is joined  # a second apply reuses it
    with torch.no_grad():  # weights loaded in place (load_state_dict) land in the joined tensor too
        owner.load_state_dict({"gate.weight": torch.ones(5, 8), "up.weight": torch.zeros(3, 8)})
    assert torch.equal(joined[:5], torch.ones(5, 8)) and torch.equal(joined[5:], torch.zeros(3, 8))
    # A weight replaced by a new tensor is no longer a view of the joined one: the separate GEMMs again.
    owner.gate.weight = torch.nn.Parameter(torch.randn(5, 8))
    assert kernels.joined_weight(owner, "_joined", owner.gate) is None


def test_projections_with_a_bias_are_not_joined():
    owner = torch.nn.Module()
    owner.gate, owner.up = torch.nn.Linear(8, 5, bias=True), torch.nn.Linear(8, 3, bias=False)
    weight = owner.gate.weight
    assert kernels.join_weights(owner, owner.gate, owner.up, "_joined") is None
    assert owner.gate.weight is weight
