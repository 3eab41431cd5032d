"""pad_collate and packed_collate against items built by hand: every value lands where the sample put it."""

import torch

from hsextract.training import packed_collate, pad_collate


def _item(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (n,), generator=g)
    return {
        "input_ids": ids,
        "loss_mask": torch.randint(0, 2, (n,), generator=g),
        "hidden_states": torch.randn(n, 6, generator=g),
        "labels": torch.cat([ids[1:], torch.tensor([-100])]),
        "lengths": torch.tensor([n]),
        "sample_id": f"s{seed}",
    }


ITEMS = [_item(5, 0), _item(2, 1), _item(7, 2)]


def test_pad_collate_pads_each_field_to_the_longest_and_masks_the_rest():
    b = pad_collate(ITEMS, pad_id=0)
    assert b["input_ids"].shape == (3, 7) and b["hidden_states"].shape == (3, 7, 6)
    for row, item in enumerate(ITEMS):
        n = len(item["input_ids"])
        for key in ("input_ids", "loss_mask", "hidden_states", "labels"):
            assert torch.equal(b[key][row, :n], item[key])
        assert (b["input_ids"][row, n:] == 0).all() and (b["labels"][row, n:] == -100).all()
        assert (b["hidden_states"][row, n:] == 0).all()
        assert b["attention_mask"][row].tolist() == [1] * n + [0] * (7 - n)
    assert b["sample_id"] == ["s0", "s1", "s2"] and b["lengths"].tolist() == [[5], [2], [7]]


def test_packed_collate_concatenates_with_cu_seqlens_that_slice_each_sample_back():
    b = packed_collate(ITEMS)
    assert b["cu_seqlens"].tolist() == [0, 5, 7, 14] and b["cu_seqlens"].dtype == torch.int32
    assert b["max_seqlen"] == 7 and b["hidden_states"].shape == (14, 6)
    for i, item in enumerate(ITEMS):
        start, end = b["cu_seqlens"][i], b["cu_seqlens"][i + 1]
        for key in ("input_ids", "loss_mask", "hidden_states", "labels"):
            assert torch.equal(b[key][start:end], item[key])
        assert b["position_ids"][start:end].tolist() == list(range(end - start))
