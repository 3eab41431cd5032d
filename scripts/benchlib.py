"""What the bench scripts share: the realistic length mix, data and outputs made of it, GPU clocks and timers.

The length mix is chat-like (lognormal, median 221 tokens, mean ~330, p99 ~1,800), the same in every bench, so
that batches, files and data compare across them. Outputs are written by ``tests/support/synthetic.py`` as a run
writes them (batch files, completion records, ``finish_output``), in the default target's shape.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

DFLASH_LAYERS, HIDDEN, NUM_LAYERS = (1, 16, 31, 46, 61), 5120, 64

"""The default target's stored states (Qwen3.6-27B, DFlash, bf16): 51,200 bytes per token."""


def realistic_lengths(total_tokens: int, max_length: int, seed: int = 0, min_length: int = 1) -> list[int]:
    """Sample lengths of the realistic mix until they add up to at least ``total_tokens``."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    total = 0
    while total < total_tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(221), 0.9), min_length, max_length)))
        total += lengths[-1]
    return lengths


def realistic_samples(total_tokens: int, vocab: int, max_length: int, seed: int = 0):
    """Tokenized samples of the realistic mix with random ids, every token supervised."""
    from hsextract.prepare.tokenfile import TokenizedSamples

    lengths = realistic_lengths(total_tokens, max_length, seed)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.random.default_rng(seed).integers(0, vocab, offsets[-1], dtype=np.int32)
    return TokenizedSamples(
        sample_ids=[str(i) for i in range(len(lengths))],
        input_ids=ids,
        loss_mask=np.ones_like(ids, dtype=np.uint8),
        offsets=offsets,
    )


def write_token_rows(path: Path, tokens: int, vocab: int, max_length: int, seed: int = 0) -> int:
    """Pre-tokenized JSONL rows of the realistic mix (``hsextract run --data`` reads them as they are); the count."""
    rng = np.random.default_rng(seed + 1)
    lengths = realistic_lengths(tokens, max_length, seed, min_length=2)
    with open(path, "w") as f:
        for n, length in enumerate(lengths):
            row = {"id": f"s{n:07d}", "input_ids": rng.integers(1, vocab, length).tolist()}
            f.write(json.dumps(row) + "\n")
    return len(lengths)


def realistic_output(out: Path, files: int, tokens: int, seed: int = 0) -> dict:
    """A finished output of ``files`` batch files of exactly ``tokens`` tokens each (the realistic mix, every token
    supervised, random bf16 states of the default target's DFlash shape); what ``synthetic.make_output`` returns."""
    from support.synthetic import make_output

    from hsextract.output import BatchSpec, Plan, StateLayout

    specs, lengths = [], []
    for b in range(files):
        mine = realistic_lengths(tokens, min(tokens, 4096), seed * 7919 + b, min_length=2)
        mine[-1] -= sum(mine) - tokens
        mine = sorted((n for n in mine if n > 1), reverse=True)
        first = len(lengths)
        lengths += mine
        specs.append(BatchSpec(b, 0, tuple(range(first, len(lengths))), mine[0], sum(mine)))
    plan = Plan(batches=tuple(specs), shards=1, fingerprint={"bench": seed, "tokens": tokens})
    ids = [f"s{i:07d}" for i in range(len(lengths))]
    layout = StateLayout(DFLASH_LAYERS, NUM_LAYERS)
    return make_output(
        str(out), files, planned=(plan, lengths, ids), layout=layout, hidden=HIDDEN, full_loss=True, threads=2
    )


def extractor(lm, layer_ids, batches, device, num_slots: int, storage_dtype: str | None = None):
    """The worker's ``Extractor`` for ``batches`` (its buffers sized for the largest), padding with id 0."""
    from hsextract.run.pipeline import Extractor

    return Extractor(
        lm,
        layer_ids,
        device=device,
        max_tokens=max(b.num_tokens for b in batches),
        num_slots=num_slots,
        pad_token_id=0,
        storage_dtype=storage_dtype,
    )


class ClockSampler:
    """SM clock (MHz) and board power (W) of the current GPU every 50 ms through NVML while a block runs: whether a
    denser stream of matrix products runs the GPU at lower clocks (the power cap) shows here, no setting touched."""

    def __init__(self):
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import torch

        while not self._stop.wait(0.05):
            try:
                self.samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
            except Exception:  # no NVML here: no samples
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks, watts = zip(*self.samples, strict=True)
        return {
            "sm_clock_mhz_mean": float(np.mean(clocks)),
            "power_w_mean": float(np.mean(watts)),
            "n": len(clocks),
        }


def cuda_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls, timed by CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def best_of(repeat: int, fn) -> float:
    """The fewest seconds ``fn`` took in ``repeat`` calls (the machines are shared: the least disturbed run)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
