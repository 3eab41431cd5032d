"""The GPU pipeline: padded batches through the hooked model, copies overlapped with compute, a writer thread.

The GPU never waits for host work: the forward's hooks (model/capture.py) gather the captured layers' valid tokens
into a device buffer laid out as the file stores them; a side stream copies it once into a reused pinned host buffer
while the next forward starts, and the writer thread hands the host tensors to ``on_batch``. A fixed set of slots
bounds memory and how far the GPU runs ahead: a slow ``on_batch`` holds the slots, and the GPU waits.
"""

# The device buffer holds fp8 with its scales when the run stores fp8; ``on_batch`` is the worker's StagingWriter, or
# the dry run's capture. With ``check_states`` each batch's states are checked on the device (``state_health``, a few
# counts riding the same copy) and a bad batch is refused (``BadStatesError``) before anything is written. With
# ``target_topk`` the slot holds the batch's top-k ids and log-probabilities too (model/capture.py computes them on
# the device), copied with the states: K values a token cross to the host, never the logits.

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from hsextract.errors import HsextractError
from hsextract.model.capture import GatherTarget, LayerCapture
from hsextract.model.prefix import capture_into
from hsextract.output import BatchSpec, StateLayout
from hsextract.prepare.tokenfile import TokenizedSamples
from hsextract.run.procs import Stopped
from hsextract.startup import host_buffer, pinned_ahead

log = logging.getLogger(__name__)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [rows, padded_length] int64, right-padded
    attention_mask: torch.Tensor  # [rows, padded_length] int64
    flat_index: torch.Tensor  # [tokens] positions of valid tokens in the flattened batch
    tokens_ids: torch.Tensor  # [tokens] int32, what the file stores
    tokens_mask: torch.Tensor  # [tokens] uint8
    cu_seqlens: torch.Tensor  # [rows + 1] int64
    sample_index: torch.Tensor  # [rows] int64

    @property
    def num_tokens(self) -> int:
        return int(self.flat_index.numel())


def build_batch(samples: TokenizedSamples, batch: BatchSpec, pad_token_id: int) -> BatchInputs:
    """Right-padded rows and the index of their valid tokens. Padding on the right keeps every valid token's
    state equal to the unpadded forward's (causal attention and the linear-attention recurrence never see it)."""
    rows, width = batch.rows, batch.padded_length
    ids = np.full((rows, width), pad_token_id, dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.int64)
    lengths = np.empty(rows, dtype=np.int64)
    flat_ids, flat_mask, flat_index = [], [], []
    for r, i in enumerate(batch.sample_indices):
        s_ids, s_mask = samples.sample(i)
        n = len(s_ids)
        ids[r, :n] = s_ids
        mask[r, :n] = 1
        lengths[r] = n
        flat_ids.append(s_ids)
        flat_mask.append(s_mask)
        flat_index.append(np.arange(r * width, r * width + n, dtype=np.int64))
    cu = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return BatchInputs(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(mask),
        flat_index=torch.from_numpy(np.concatenate(flat_index)),
        tokens_ids=torch.from_numpy(np.concatenate(flat_ids).astype(np.int32)),
        tokens_mask=torch.from_numpy(np.concatenate(flat_mask).astype(np.uint8)),
        cu_seqlens=torch.from_numpy(cu),
        sample_index=torch.tensor(batch.sample_indices, dtype=torch.int64),
    )


class BadStatesError(HsextractError):
    """A batch's states hold non-finite values or all-zero token vectors: stored, they would train nothing."""


def state_health(
    out: torch.Tensor, scale: torch.Tensor | None, topk_logprobs: torch.Tensor | None = None
) -> torch.Tensor:
    """[2, slots] int64 on the device: per slot, the tokens whose state holds a NaN or Inf, and those whose state
    is all zeros. ``out`` is [tokens, slots, hidden]; with fp8 storage ``scale`` [tokens, slots] tells both (a
    non-finite vector has a non-finite scale, an all-zero one scale 0: fp8.py). With the target's top-k one more
    column: the tokens whose top-k log-probabilities hold a NaN or Inf (the final state's, seen through lm_head)."""
    if scale is not None:
        bad, zero = ~torch.isfinite(scale), scale == 0
    else:
        high, low = out.amax(dim=2), out.amin(dim=2)  # NaN propagates through both
        bad = ~(torch.isfinite(high) & torch.isfinite(low))
        zero = (high == 0) & (low == 0)
    if topk_logprobs is not None:
        bad = torch.cat([bad, ~torch.isfinite(topk_logprobs).all(dim=1, keepdim=True)], dim=1)
        zero = torch.cat([zero, torch.zeros_like(zero[:, :1])], dim=1)
    return torch.stack([bad.sum(dim=0), zero.sum(dim=0)])


def refuse_bad_states(health: torch.Tensor, batch: BatchSpec, layer_ids, dtype) -> None:
    """Raise ``BadStatesError`` naming the batch and the first bad layer, if ``health`` (``state_health``) counts
    any bad token."""
    counts = health.tolist()
    names = [f"layer {layer}" for layer in layer_ids]
    names += ["the target's top-k"] * (len(counts[0]) - len(names))  # state_health's top-k column
    for slot, name in enumerate(names):
        bad, zero = counts[0][slot], counts[1][slot]
        if bad or zero:
            what = (
                f"{bad} token(s) with NaN or Inf values"
                if bad
                else f"{zero} token(s) whose state is all zeros"
            )
            raise BadStatesError(
                f"batch {batch.batch_id} (shard {batch.shard}, {batch.key}): {name} has {what} "
                f"of {batch.num_tokens}, in {str(dtype).removeprefix('torch.')}. Stored, they would train "
                "nothing: check the model (hsextract dry-run shows each layer's health; float16 overflows "
                "where bfloat16 does not), or pass --no-check-states if such states are expected"
            )


class Slot:
    """A device gather buffer and the host buffer its contents are copied to (the same tensor on CPU), and with
    fp8 storage the same pair for the scales."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        scale_numel: int = 0,
        topk_numel: int = 0,
    ):
        self.device_buf = torch.empty(numel, dtype=dtype, device=device)
        self.device_scale = torch.empty(scale_numel, dtype=torch.float32, device=device)
        self.device_topk_ids = torch.empty(topk_numel, dtype=torch.int32, device=device)
        self.device_topk_logprobs = torch.empty(topk_numel, dtype=torch.float32, device=device)
        self.health: torch.Tensor | None = None
        """``state_health`` of the batch in the slot, on the host once copied."""
        self.host_health: torch.Tensor | None = None
        """The pinned host buffer ``health`` is copied into on CUDA, made at the first checked batch."""
        if device.type == "cuda":
            self.host_buf = host_buffer(numel, dtype)  # exact size, maybe made ahead (startup/hostmem.py)
            self.host_scale = torch.empty(scale_numel, dtype=torch.float32, pin_memory=True)
            self.host_topk_ids = torch.empty(topk_numel, dtype=torch.int32, pin_memory=True)
            self.host_topk_logprobs = torch.empty(topk_numel, dtype=torch.float32, pin_memory=True)
            self.copied = torch.cuda.Event()
        else:
            self.host_buf = self.device_buf
            self.host_scale = self.device_scale
            self.host_topk_ids = self.device_topk_ids
            self.host_topk_logprobs = self.device_topk_logprobs
            self.copied = None


class Extractor:
    """Runs batches through the hooked model and hands each batch's tensors, on the host, to ``on_batch``
    in a writer thread, overlapping the copy and the write with the next forward.

    ``layer_ids`` are the layers whose outputs fill the slots, in slot order (``StateLayout.slot_layers``: the
    captured ids, then the last layer for the final state). ``storage_dtype="float8_e4m3fn"`` stores fp8 values and
    adds ``hidden_states_scale`` [tokens, slots] to the tensors handed to ``on_batch``; ``target_topk=K`` adds the
    target's top-k, ``target_topk_ids`` and ``target_topk_logprobs`` [tokens, K]. ``share_prefixes`` runs each
    batch's rows one at a time through the model's cache, each shared prefix once (model/prefix.py), instead of
    one padded forward; the states are the same."""

    def __init__(
        self,
        lm,
        layer_ids,
        *,
        device: torch.device,
        max_tokens: int,
        num_slots: int,
        pad_token_id: int,
        storage_dtype: str | None = None,
        check_states: bool = False,
        target_topk: int | None = None,
        share_prefixes: bool = False,
    ):
        self.lm = lm
        self.share_prefixes = share_prefixes
        self.layer_ids = tuple(layer_ids)
        self.device = device
        self.pad_token_id = pad_token_id
        self.hidden = lm.config.get_text_config().hidden_size
        self.scaled = storage_dtype is not None
        self.dtype = getattr(torch, storage_dtype) if self.scaled else next(lm.parameters()).dtype
        numel = max_tokens * len(self.layer_ids) * self.hidden
        scale_numel = max_tokens * len(self.layer_ids) if self.scaled else 0
        self.target_topk = target_topk
        topk_numel = max_tokens * (target_topk or 0)
        t0 = time.perf_counter()
        with pinned_ahead() as (ahead, ahead_s):
            self.slots = [Slot(numel, self.dtype, device, scale_numel, topk_numel) for _ in range(num_slots)]
        log.info(
            "%d buffer slots of %.2f GB made in %.1f s%s",
            num_slots,
            numel * self.slots[0].device_buf.element_size() / 1e9 if self.slots else 0.0,
            time.perf_counter() - t0,
            f" ({ahead} host buffer(s) pinned ahead, in {ahead_s:.1f} s)" if ahead else "",
        )
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.check_states = check_states

    def run(
        self, batches, samples: TokenizedSamples, on_batch, *, stop: threading.Event | None = None
    ) -> None:
        """``on_batch(batch, tensors)`` runs in the pipeline's writer thread; its tensors alias a slot that is
        reused once it returns. Once ``stop`` is set, no further batch starts and ``Stopped`` is raised."""
        free: queue.Queue = queue.Queue()
        for s in self.slots:
            free.put(s)
        work: queue.Queue = queue.Queue()
        failure: list[BaseException] = []
        t_start = time.perf_counter()

        def writer():
            first = True
            while (item := work.get()) is not None:
                slot, batch, inputs = item
                try:
                    if failure:
                        continue
                    if slot.copied is not None:
                        slot.copied.synchronize()
                    if first:  # the first forward pays for kernels loaded, libraries started, memory reserved
                        log.info(
                            "first batch on the host %.1f s after the loop started",
                            time.perf_counter() - t_start,
                        )
                        first = False
                    if slot.health is not None:
                        refuse_bad_states(slot.health, batch, self.layer_ids, self.lm.dtype)
                    n, slots = inputs.num_tokens, len(self.layer_ids)
                    states = slot.host_buf[: n * slots * self.hidden].view(n, slots, self.hidden)
                    extra = {}  # the per-token tensors some runs store beside the states
                    if self.scaled:
                        extra["hidden_states_scale"] = slot.host_scale[: n * slots].view(n, slots)
                    if k := self.target_topk:
                        extra[StateLayout.TOPK_IDS] = slot.host_topk_ids[: n * k].view(n, k)
                        extra[StateLayout.TOPK_LOGPROBS] = slot.host_topk_logprobs[: n * k].view(n, k)
                    on_batch(
                        batch,
                        {
                            "hidden_states": states,
                            **extra,
                            "input_ids": inputs.tokens_ids,
                            "loss_mask": inputs.tokens_mask,
                            "cu_seqlens": inputs.cu_seqlens,
                            "sample_index": inputs.sample_index,
                        },
                    )
                except BaseException as e:  # surfaced in the main thread
                    failure.append(e)
                finally:
                    free.put(slot)

        thread = threading.Thread(target=writer, name="batch-writer", daemon=True)
        thread.start()
        try:
            with (
                LayerCapture(self.lm, self.layer_ids, self.target_topk) as cap,
                torch.inference_mode(),
            ):
                for batch in batches:
                    slot = self._take(free, failure, stop)
                    inputs = build_batch(samples, batch, self.pad_token_id)
                    n, slots = inputs.num_tokens, len(self.layer_ids)
                    out = slot.device_buf[: n * slots * self.hidden].view(n, slots, self.hidden)
                    scale = slot.device_scale[: n * slots].view(n, slots) if self.scaled else None
                    k = self.target_topk or 0
                    topk_ids = slot.device_topk_ids[: n * k].view(n, k) if k else None
                    topk_logprobs = slot.device_topk_logprobs[: n * k].view(n, k) if k else None
                    target = GatherTarget(
                        flat_index=inputs.flat_index.to(self.device, non_blocking=True),
                        out=out,
                        scale=scale,
                        topk_ids=topk_ids,
                        topk_logprobs=topk_logprobs,
                    )
                    if self.share_prefixes:  # row by row, each shared prefix once, unpadded
                        rows = inputs.tokens_ids.to(self.device, torch.int64).split(
                            inputs.cu_seqlens.diff().tolist()
                        )
                        capture_into(cap, rows, target)
                    else:
                        cap.forward(
                            inputs.input_ids.to(self.device, non_blocking=True),
                            inputs.attention_mask.to(self.device, non_blocking=True),
                            target,
                        )
                    health = state_health(out, scale, topk_logprobs) if self.check_states else None
                    slot.health = health
                    if self.copy_stream is not None:
                        # The copy waits for this forward only; the next forward starts at once on the main stream.
                        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                        with torch.cuda.stream(self.copy_stream):
                            if health is not None:
                                health.record_stream(self.copy_stream)  # read here after the loop drops it
                                # Into pinned memory: a copy to pageable memory would make the host wait for
                                # this forward before it can launch the next.
                                if slot.host_health is None:
                                    slot.host_health = torch.empty(
                                        health.shape, dtype=health.dtype, pin_memory=True
                                    )
                                slot.health = slot.host_health.copy_(health, non_blocking=True)
                            slot.host_buf[: out.numel()].copy_(out.view(-1), non_blocking=True)
                            if scale is not None:
                                slot.host_scale[: scale.numel()].copy_(scale.view(-1), non_blocking=True)
                            if topk_ids is not None:
                                slot.host_topk_ids[: topk_ids.numel()].copy_(
                                    topk_ids.view(-1), non_blocking=True
                                )
                                slot.host_topk_logprobs[: topk_logprobs.numel()].copy_(
                                    topk_logprobs.view(-1), non_blocking=True
                                )
                            slot.copied.record(self.copy_stream)
                    work.put((slot, batch, inputs))
        except BaseException as e:
            failure.append(e)  # the writer skips the batches still queued instead of writing them
            raise
        finally:
            work.put(None)
            thread.join()
        if failure:
            raise failure[0]

    @staticmethod
    def _take(free: queue.Queue, failure: list, stop: threading.Event | None):
        """A free slot; the writer's failure, or ``Stopped``, while waiting for one."""
        while True:
            if failure:
                raise failure[0]
            if stop is not None and stop.is_set():
                raise Stopped
            try:
                return free.get(timeout=0.1)
            except queue.Empty:
                continue


def measure_rate(lm, layout: StateLayout, plan, samples, device, pad_token_id) -> tuple[float, dict]:
    """The dry run's estimate: tokens/s of the capture path on a typical batch of the real plan (the median by padded size), timed on its
    second pass so kernel compilation stays out. The proof batch is too small to say anything about speed."""
    batch = sorted(plan.batches, key=lambda b: b.padded_tokens)[len(plan.batches) // 2]
    # A plan over a sample's repeated lengths names sample i as i + k * n.
    batch = replace(batch, sample_indices=tuple(i % len(samples) for i in batch.sample_indices))
    extractor = Extractor(
        lm,
        layout.slot_layers,
        device=device,
        max_tokens=batch.num_tokens,
        num_slots=2,
        pad_token_id=pad_token_id,
        storage_dtype=layout.storage_dtype,
        target_topk=layout.target_topk,
    )
    extractor.run([batch], samples, lambda b, t: None)
    t0 = time.perf_counter()
    extractor.run([batch], samples, lambda b, t: None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    shape = {
        "rows": batch.rows,
        "padded_length": batch.padded_length,
        "tokens": batch.num_tokens,
        "seconds": seconds,
    }
    return batch.num_tokens / seconds, shape
