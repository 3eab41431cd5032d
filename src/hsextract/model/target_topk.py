"""The target's top-k (``--target-topk K``): computed on the device from the final normed state, checked against
the model before it loads, and compared with a reference forward's logits (the dry run's proof).

``lm_head`` runs on a chunk of tokens at a time, so the full-vocabulary logits exist for one chunk only; the
normalizer is a float32 logsumexp over the whole vocabulary, and only K ids and log-probabilities are kept. No
torch at import (tensor methods only): preparation checks K here.
"""

from __future__ import annotations

from hsextract.errors import HsextractError

LOGITS_CHUNK_BYTES = 1 << 30

"""Float32 logits held at once by ``target_topk_``: 1,081 tokens of a 248,320-token vocabulary (plus the same
chunk in the model dtype), small next to a batch's activations, large enough that each lm_head GEMM is efficient."""


def logits_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of ``target_topk_`` for ``vocab_size``-wide logits."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def target_topk_(normed, lm_head, ids_out, logprobs_out, *, chunk_tokens: int) -> None:
    """The top-k next tokens of every row of ``normed`` [tokens, H] (the final normed state): ``lm_head`` on
    ``chunk_tokens`` rows at a time, log-softmax with the logsumexp over the whole vocabulary in float32, then the
    K = ``ids_out.shape[1]`` largest, written to ``ids_out`` (int32) and ``logprobs_out`` (float32) [tokens, K].
    Never more than one chunk's logits exist; they stay on ``normed``'s device."""
    k = ids_out.shape[1]
    for start in range(0, normed.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, normed.shape[0])
        logits = lm_head(normed[start:stop]).float()  # the model dtype's logits, as HF's, then float32
        values, ids = logits.topk(k, dim=-1)
        logprobs_out[start:stop] = values - logits.logsumexp(dim=-1, keepdim=True)
        ids_out[start:stop] = ids
        del logits


def check_target_topk(k: int | None, text_config) -> None:
    """``--target-topk K`` fits the model: K at most its vocabulary, and logits that are plain ``lm_head``
    outputs (no soft-capping or scaling the capture would not apply). Read from the config: no weight loaded."""
    if not k:
        return
    vocab = getattr(text_config, "vocab_size", None)
    if vocab is not None and k > vocab:
        raise HsextractError(
            f"--target-topk {k} exceeds the model's vocabulary of {vocab} tokens: give a K of at most {vocab}"
        )
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(text_config, name, None) not in (None, 1, 1.0):
            raise HsextractError(
                f"--target-topk: the model's config sets {name}={getattr(text_config, name)!r}, which its logits "
                "apply after lm_head; hsextract computes the top-k from lm_head alone. Leave --target-topk out"
            )


REFERENCE_ROWS = 1024

"""Tokens of the reference's logits made float32 at once."""


class TopkAgreement:
    """The stored top-k against the reference's logits, sample by sample: the error of the stored log-probabilities
    at their ids, and the stored ids HF ranks below its own K-th by more than twice that error (a different id
    within the error is a tie)."""

    def __init__(self):
        self.sq_err = self.sq_ref = self.max_abs = 0.0
        self.tokens = self.same_sets = 0
        self.worst: list[float] = []  # per token: HF's K-th log-prob minus its lowest at the stored ids

    def add(self, ids, logprobs, logits) -> None:
        """``ids``, ``logprobs`` [T, K] as stored; ``logits`` [T, vocab] of HF's unbatched forward."""
        k = ids.shape[1]
        for a in range(0, logits.shape[0], REFERENCE_ROWS):
            ref = logits[a : a + REFERENCE_ROWS].float().log_softmax(-1).cpu()
            got_ids, got = ids[a : a + len(ref)].long(), logprobs[a : a + len(ref)].double()
            at = ref.gather(1, got_ids).double()
            ref_top = ref.topk(k, dim=-1)
            self.sq_err += float(((got - at) ** 2).sum())
            self.sq_ref += float((at**2).sum())
            self.max_abs = max(self.max_abs, float((got - at).abs().max()) if got.numel() else 0.0)
            self.worst += (ref_top.values[:, -1].double() - at.min(dim=1).values).tolist()
            self.same_sets += int((ref_top.indices.sort(-1).values == got_ids.sort(-1).values).all(-1).sum())
            self.tokens += len(ref)

    def summary(self) -> dict:
        slack = 2 * self.max_abs + 1e-6
        return {
            "tokens": self.tokens,
            "rel_err_vs_hf": (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref else 0.0,
            "max_abs_err": self.max_abs,
            "same_id_sets": self.same_sets,
            "ids_outside": sum(w > slack for w in self.worst),
        }
