"""hsextract.model.qwen3_5 where no GPU is needed: the right-padding rule, and that CPU models are left alone."""

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
