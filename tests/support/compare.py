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


def assert_topk_matches_hf(ids, logprobs, logits, tol=1e-4, where=""):
    """``ids`` [T, K] and ``logprobs`` [T, K] equal HF's ``logits.log_softmax(-1).topk(K)`` (``logits`` [T, vocab]):
    the log-probabilities within ``tol``; the ids wherever a value stands apart from its neighbours in the ranking
    by more than ``tol`` (ties may come in either order)."""
    k = ids.shape[1]
    ref = logits.float().log_softmax(-1).topk(k)
    assert ids.dtype == torch.int32 and logprobs.dtype == torch.float32, where
    torch.testing.assert_close(logprobs, ref.values, atol=tol, rtol=0, msg=lambda m: f"{where}: {m}")
    gaps = ref.values[:, :-1] - ref.values[:, 1:]  # >= 0, sorted descending
    apart = torch.ones_like(ref.values, dtype=torch.bool)
    apart[:, :-1] &= gaps > tol
    apart[:, 1:] &= gaps > tol
    assert apart.float().mean() > 0.5, f"{where}: too many ties for the ids to say anything"
    assert torch.equal(ids.long()[apart], ref.indices[apart]), where
