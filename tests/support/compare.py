"""Equality of nested items (what a DataLoader yields: dicts of tensors and plain values) for tests that compare two
paths."""

import torch


def assert_same(a, b, where=""):
    """Equal nested batches: tensors equal in dtype, shape and values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where
