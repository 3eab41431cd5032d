"""The EAGLE-3 drafter of the proof by drafter (scripts/bench_drafter.py): speculators' `Eagle3DraftModel`, built,
fed and measured as `speculators train --speculator-type eagle3` does with its defaults.

It reads three auxiliary layers (hsextract's `eagle3` preset: the outputs of layers 1, 14 and 26 of 30, which
speculators counts as inputs 2, 15 and 27, its own default) and the verifier's last hidden state before the final
norm (its `verifier_last_hidden_states`, the hs file's last slot), through the same `ArrowDataset` and collator with
speculators' `shift_batch`. Its metrics are speculators' own, per draft step k (test-time-training step):
`full_acc_k`, the share of supervised positions whose first k+1 draft tokens are all right, and `cond_acc_k`, the
share right at step k where steps 0..k-1 were. `eal` here is 1 + sum_k full_acc_k: the expected accepted length of
a chain of `TTT_STEPS` draft tokens plus the target's bonus token.
"""

from __future__ import annotations

from pathlib import Path

TTT_STEPS = 3  # speculators' default unrolling, and the draft tokens per step of the chain


def is_eagle3(model) -> bool:
    from speculators.models.eagle3 import Eagle3DraftModel

    return isinstance(model, Eagle3DraftModel)


def new_eagle3(target: Path, layer_ids: list[int], device: str, seed: int, vocab):
    """speculators' defaults for `--speculator-type eagle3`: one Llama draft layer, norm before the residual, before
    the fc and on the output, the target's frozen embeddings and head, KL loss over 3 TTT steps."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(seed)
    config = create_transformer_layer_config(
        str(target), num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=2048,
        full_attention_indices=[0],
    )  # fmt: skip
    model = Eagle3DraftModel.from_training_args(
        config, t2d=vocab[1], d2t=vocab[0], draft_vocab_size=len(vocab[0]), norm_before_residual=True,
        norm_before_fc=True, norm_output=True, ttt_steps=TTT_STEPS, verifier_name_or_path=str(target),
        target_layer_ids=[k + 1 for k in layer_ids],  # speculators counts the input of layer k
        draft_attn_impl="sdpa",
    )  # fmt: skip
    return model.to(device=device, dtype=torch.float32)


def preprocess():
    from speculators.models.eagle3 import shift_batch

    return shift_batch


def step_kwargs() -> dict:
    from speculators.models.eagle3 import Eagle3DraftModel

    _, val = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=TTT_STEPS, ttt_step_loss_decay=1.0
    )
    return val


def summarize(ratios: dict[str, float]) -> dict:
    """The table's columns from speculators' pooled metrics (each `X_sum / X_total`)."""
    full = [ratios[f"full_acc_{k}"] for k in range(TTT_STEPS)]
    return {"eal": 1.0 + sum(full), "full_acc": full[0], "loss": ratios["loss"],
            "position_acc": [round(a, 4) for a in full],
            "cond_acc": [round(ratios[f"cond_acc_{k}"], 4) for k in range(TTT_STEPS)]}  # fmt: skip
