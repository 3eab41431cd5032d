"""``hsextract dry-run``: prove the captured layers are the intended ones, check their health, estimate the job.

A few real samples run through the worker's own path and, one at a time, a plain HF forward: id k must match HF
index k+1 and be clearly farther from k and k+2, so an off-by-one cannot pass. Health per layer (mean, std, absmax, NaN/Inf, zero vectors); top-k and fp8 compute proven against the
reference; the estimate uses the plan ``run`` would make and the throughput measured here.
"""

# The match is within the dtype's tolerance; the final state is checked through the norm the reader applies. With
# fp8 storage each row also reports the fp8 error against the unquantized capture (the identity proof runs
# unquantized: fp8's error is of the order of adjacent layers' distance). The top-k is proven against the reference
# forward's logits.log_softmax(-1) (values within tolerance; ids among HF's top K up to that error). The estimate
# runs on the whole data's lengths when the token cache holds them, else on sampled rows repeated to the data's size
# (the output says which).

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from hsextract.config import DTYPE_BYTES, STORAGE_DTYPES, RunConfig
from hsextract.dryrun_report import format_report
from hsextract.layers import (
    FINAL_STATE_PRESETS,
    describe_layer,
    layer_types,
    presets_layer_ids,
    resolve_layer_ids,
)
from hsextract.model import qwen3_5 as kernels
from hsextract.model.capture import model_final_norm
from hsextract.model.checkpoint import check_checkpoint
from hsextract.model.load import final_norm, load_model_config, load_model_for, torch_device
from hsextract.model.target_topk import TopkAgreement, check_target_topk
from hsextract.output import (
    BatchSpec,
    StateLayout,
    dequantize_fp8,
)
from hsextract.prepare.chat import marked_text
from hsextract.prepare.plan import make_plan
from hsextract.prepare.tokenize import SampledData, load_sample, load_tokenizer
from hsextract.run.pipeline import Extractor, measure_rate
from hsextract.run.preflight import encoding_options, resolve_data, run_layout
from hsextract.run.rundir import RunDir
from hsextract.startup import fast_load, ready
from hsextract.training.schemas import served_by

# Relative L2 error allowed between the batched capture and the unbatched reference.
TOLERANCE = {"float32": 1e-4, "float16": 3e-2, "bfloat16": 3e-2}


TOPK_TOLERANCE = {"float32": 1e-4, "float16": 3e-2, "bfloat16": 3e-2}

"""Relative L2 error allowed between the stored top-k log-probabilities and the reference's at the same ids."""


FP8_TOLERANCE = 5e-2  # relative L2 of the fp8 states against the unquantized capture (measured ~2.6%)

# fp8 compute: padding moves a few activations across an e4m3 rounding, so the layer-id proof allows bf16's tolerance in
# every dtype (far under the neighbour layers' distance, which it must also beat); the recipe check proves numerics.
FP8_COMPUTE_TOLERANCE = 3e-2


__all__ = ["DryRunResult", "dry_run", "format_report"]


HEADER_BYTES_PER_SAMPLE = 16  # sample id JSON in the file header, approximate


HEADER_BYTES_FIXED = 1200


@dataclass
class DryRunResult:
    report: dict
    ok: bool


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else float("inf") if a.norm().item() > 0 else 0.0


def pick_samples(lengths: np.ndarray, n: int, max_tokens: int) -> list[int]:
    """``n`` sample indices spread over the length distribution (shortest to longest), fitting one batch."""
    order = np.argsort(lengths, kind="stable")
    picks = sorted({int(order[round(q * (len(order) - 1))]) for q in np.linspace(0, 1, min(n, len(order)))})
    while picks and len(picks) * max(lengths[i] for i in picks) > max_tokens:
        picks.pop()  # drop the longest until the proof batch fits the batch budget
    return picks


def dry_run(cfg: RunConfig, *, num_samples: int = 8, echo=print, lm=None) -> DryRunResult:
    """Run the proof, the health check and the estimate. ``lm``: a model already loaded (tests)."""
    weights = lm is None and not cfg.random_weights
    check_checkpoint(cfg.model_path, weights=weights, tokenizer=cfg.tokenizer_dir or cfg.tokenizer)
    _config, text, num_layers = load_model_config(cfg.model_path, cfg.trust_remote_code)
    layer_ids = resolve_layer_ids(cfg.layers, num_layers)
    layout = run_layout(cfg, layer_ids, num_layers)
    check_target_topk(cfg.target_topk, text)
    tokenizer = load_tokenizer(
        cfg.tokenizer_path, cfg.trust_remote_code, "--tokenizer" if cfg.tokenizer else "--model"
    )
    run_dir = RunDir(cfg.run_dir)
    options = encoding_options(cfg, run_dir)
    chat = options["chat"]
    echo("dry-run: tokenizing a sample of the data")
    sampled = load_sample(resolve_data(cfg, run_dir), tokenizer, **options)
    samples = sampled.samples
    device = torch_device(cfg)
    if lm is None:
        echo("dry-run: loading the weights")
        lm = load_model_for(cfg, device, fast_load)
        ready(device)
    norm = model_final_norm(lm) if layout.final_state else None
    echo(
        "dry-run: proving the layer ids: the run's batched capture of a few samples, then a plain forward of each"
    )
    proof = prove_layers(
        lm,
        layout,
        samples,
        device=device,
        num_samples=num_samples,
        cfg=cfg,
        pad_token_id=tokenizer.pad_token_id,
        norm=norm,
    )
    compute = getattr(lm, "hsx_compute", "bf16")
    tol = FP8_COMPUTE_TOLERANCE if compute.startswith("fp8") else TOLERANCE[cfg.dtype]
    layers_report, warnings = layer_health(proof, layout, layer_types(text), tol, cfg.dtype)
    topk_report = None
    if proof.topk is not None:
        topk_report = {**proof.topk, "tolerance": TOPK_TOLERANCE[cfg.dtype]}
        topk_report["ok"] = bool(
            topk_report["rel_err_vs_hf"] <= topk_report["tolerance"] and not topk_report["ids_outside"]
        )
        if not topk_report["ok"]:
            warnings.append(
                f"target top-{layout.target_topk}: the stored log-probabilities differ from HF's "
                f"logits.log_softmax(-1) by {topk_report['rel_err_vs_hf']:.2e} (tolerance "
                f"{topk_report['tolerance']:.0e}), {topk_report['ids_outside']} stored id(s) outside HF's top "
                f"{layout.target_topk}"
            )
    rendering, notes = sampled.report.rendering_lines("sampled ")
    warnings += rendering
    fp8_check = None
    if compute.startswith("fp8"):
        echo("dry-run: checking the fp8 compute against its recipe (seven forwards of two samples)")
        fp8_check = check_fp8(lm, cfg, layout, proof, samples, device)
        warnings += fp8_check["warnings"]
    ok = all(e["ok"] for e in layers_report) and not warnings
    echo("dry-run: timing a typical batch of the plan for the estimate (run twice, the second timed)")
    estimated = estimate(cfg, lm, layout, text.hidden_size, sampled, device, tokenizer.pad_token_id)
    report = {
        "model": cfg.model,
        "model_dir": cfg.model_path,
        "model_commit": cfg.model_commit,
        "tokenizer": cfg.tokenizer,
        "tokenizer_dir": cfg.tokenizer_path,
        "tokenizer_commit": cfg.tokenizer_commit,
        "chat": {
            "template": cfg.chat_template or "the tokenizer's own",
            "kwargs": chat.kwargs,
            "first_sample": marked_text(tokenizer, *samples.sample(0)) if len(samples) else "",
        },
        "num_layers": num_layers,
        "layers": layers_report,
        "final_state": None if norm is None else {"layer": num_layers - 1, **norm.describe()},
        "storage_dtype": layout.storage_dtype or cfg.dtype,
        "compute": compute,
        "fp8_check": fp8_check,
        "target_topk": topk_report,
        "proof": {
            "samples": proof.num_samples,
            "tokens": proof.num_tokens,
            "dtype": cfg.dtype,
            "tolerance": tol,
            "fp8_tolerance": FP8_TOLERANCE if layout.scaled else None,
            "first_batch_s": proof.seconds,
        },
        "warnings": warnings,
        "notes": notes,
        "ok": ok,
        "estimate": estimated,
    }
    return DryRunResult(report=report, ok=ok)


@dataclass
class Proof:
    """The production path's capture of a few samples, and its distance to the reference per layer."""

    states: torch.Tensor
    """[tokens, slots, hidden] float32, as the pipeline captured them (unquantized)."""
    rows: list
    """(sample index, first token, end) of each sample's rows in ``states``, longest first."""
    errors: dict
    """layer id -> {"match": [...], "prev": [...], "next": [...]} relative errors per sample vs HF k+1, k, k+2."""
    fp8: torch.Tensor | None
    """[tokens, slots, hidden] float32: the same batch through the fp8 pipeline, dequantized (fp8 storage only)."""
    topk: dict | None
    num_samples: int
    num_tokens: int
    seconds: float


def prove_layers(
    lm, layout: StateLayout, samples, *, device, num_samples, cfg, pad_token_id, norm=None
) -> Proof:
    """A few samples spread over the length distribution through the worker's Extractor (padded batch, hooks,
    early exit, on-device gather, host copy), and one at a time through a plain HF forward. ``norm`` (the final
    state's FinalNorm) is applied to the last layer's capture before comparing it with HF's normed last entry."""
    lengths = samples.lengths
    picks = pick_samples(lengths, num_samples, cfg.max_tokens_per_batch)
    order = sorted(picks, key=lambda i: (-lengths[i], i))
    batch = BatchSpec(
        batch_id=0,
        shard=0,
        sample_indices=tuple(order),
        padded_length=int(lengths[order[0]]),
        num_tokens=int(sum(lengths[i] for i in order)),
    )
    slot_layers = layout.slot_layers

    def capture(storage_dtype):
        captured: dict = {}
        extractor = Extractor(
            lm,
            slot_layers,
            device=device,
            max_tokens=batch.num_tokens,
            num_slots=1,
            pad_token_id=pad_token_id,
            storage_dtype=storage_dtype,
            target_topk=layout.target_topk,
        )
        extractor.run(
            [batch], samples, lambda b, tensors: captured.update({k: v.clone() for k, v in tensors.items()})
        )
        return captured

    t0 = time.perf_counter()
    captured = capture(None)
    seconds = time.perf_counter() - t0
    states = captured["hidden_states"].float()  # [N, slots, H]
    cu = captured["cu_seqlens"].tolist()
    fp8 = None
    if layout.scaled:
        q = capture(layout.storage_dtype)
        fp8 = dequantize_fp8(q["hidden_states"], q["hidden_states_scale"], torch.float32)

    # The reference: unbatched HF forward per sample, on transformers' own modules, never the fused ones the capture
    # may use. Under fp8 compute it runs the capture's own layer forwards instead: fp8 rounding is discontinuous, so
    # two right implementations of the recipe differ as much as each differs from it; the recipe check (check_fp8)
    # proves those numerics against an independent float32 forward, and this proof holds the layer ids.
    same_forward = getattr(lm, "hsx_compute", "bf16").startswith("fp8")
    num_layers = lm.config.get_text_config().num_hidden_layers
    if norm is None and num_layers - 1 in slot_layers:
        norm = final_norm(lm)  # the last layer captured without --final-state: HF's own norm module
    errors = {k: {"match": [], "prev": [], "next": []} for k in slot_layers}
    topk = TopkAgreement() if layout.target_topk else None
    with torch.inference_mode(), contextlib.nullcontext() if same_forward else kernels.stock_forward(lm):
        for row, i in enumerate(tqdm(order, desc="dry-run: plain forwards", unit="sample", leave=False)):
            ids, _ = samples.sample(i)
            out = lm(
                torch.from_numpy(ids.astype(np.int64)).to(device)[None],
                output_hidden_states=True,
                use_cache=False,
            )
            ref = out.hidden_states
            if topk is not None:
                a, b = cu[row], cu[row + 1]
                topk.add(
                    captured[StateLayout.TOPK_IDS][a:b],
                    captured[StateLayout.TOPK_LOGPROBS][a:b],
                    out.logits[0],
                )
            del out
            got_rows = states[cu[row] : cu[row + 1]]
            for j, k in enumerate(slot_layers):
                got = got_rows[:, j]
                if k + 1 == num_layers:  # HF's last entry is normed: norm ours too
                    got = norm(got.to(ref[k + 1].dtype).to(device)).float().cpu()
                errors[k]["match"].append(_rel(got, ref[k + 1][0].float().cpu()))
                errors[k]["prev"].append(_rel(got, ref[k][0].float().cpu()))
                if k + 2 < len(ref):
                    errors[k]["next"].append(_rel(got, ref[k + 2][0].float().cpu()))
    return Proof(
        states=states,
        rows=[(i, cu[row], cu[row + 1]) for row, i in enumerate(order)],
        errors=errors,
        fp8=fp8,
        topk=None if topk is None else topk.summary(),
        num_samples=len(order),
        num_tokens=batch.num_tokens,
        seconds=seconds,
    )


def check_fp8(lm, cfg: RunConfig, layout: StateLayout, proof: Proof, samples, device) -> dict:
    """fp8 compute held against its recipe and the recipe's wrong variants (model/fp8_check.py), on the two proof
    samples nearest the median length: each costs seven unbatched forwards."""
    from hsextract.model.fp8_check import check_compute
    from hsextract.model.fp8_load import is_fp8_checkpoint

    mid = len(proof.rows) // 2
    rows = proof.rows[max(0, mid - 1) : mid + 1]
    return check_compute(
        lm,
        cfg.model_path,
        not cfg.random_weights and is_fp8_checkpoint(cfg.model_path),
        layout.slot_layers,
        [samples.sample(i)[0] for i, _, _ in rows],
        [proof.states[a:b] for _, a, b in rows],
        device,
    )


def layer_health(proof: Proof, layout: StateLayout, types, tol: float, dtype: str) -> tuple[list, list]:
    """Per slot: the proof's verdict (matches HF k+1 within ``tol`` and is clearly farther from k and k+2), the
    fp8 error (fp8 storage), and the states' health (NaN, Inf, all-zero token vectors). Returns the rows and the
    warnings."""
    rows, warnings = [], []
    num_layers = layout.num_layers
    for j, k in enumerate(layout.slot_layers):
        match = max(proof.errors[k]["match"])
        neighbours = proof.errors[k]["prev"] + proof.errors[k]["next"]
        nearest = min(neighbours) if neighbours else float("inf")
        x = proof.states[:, j] if proof.fp8 is None else proof.fp8[:, j]
        finite = torch.isfinite(x)
        zero_rows = int((x == 0).all(dim=-1).sum())
        entry = {
            **describe_layer(k, num_layers),
            "layer_type": types[k],
            "final_state": j == layout.final_slot,
            "rel_err_vs_hf": match,
            "rel_err_vs_neighbour_layers": nearest,
            "mean": float(x[finite].mean()) if finite.any() else float("nan"),
            "std": float(x[finite].std()) if finite.sum() > 1 else float("nan"),
            "absmax": float(x[finite].abs().max()) if finite.any() else float("nan"),
            "nan": int(torch.isnan(x).sum()),
            "inf": int(torch.isinf(x).sum()),
            "zero_tokens": zero_rows,
        }
        if entry["final_state"]:
            entry["captures"] = f"final state: layer {k} output, pre-norm"
        entry["ok"] = bool(match <= tol and match < nearest / 4)
        if proof.fp8 is not None:
            ref = proof.states[:, j].double()
            got = proof.fp8[:, j].double()
            entry["fp8_rel_err"] = ((got - ref).norm() / ref.norm()).item()
            entry["fp8_cos_min"] = torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item()
            if not entry["fp8_rel_err"] <= FP8_TOLERANCE:
                entry["ok"] = False
                warnings.append(
                    f"layer {k}: fp8 storage differs from the unquantized capture by {entry['fp8_rel_err']:.2e} "
                    f"(tolerance {FP8_TOLERANCE:.0e})"
                )
        if not entry["ok"]:
            if math.isfinite(match) and nearest < match:
                warnings.append(
                    f"layer {k}: capture matches a NEIGHBOUR layer better than HF index {k + 1}: "
                    f"an off-by-one between the capture and the intended layer"
                )
            else:
                warnings.append(
                    f"layer {k}: capture differs from HF output_hidden_states[{k + 1}] by {match:.2e} "
                    f"(tolerance {tol:.0e} for {dtype})"
                )
        if entry["nan"] or entry["inf"]:
            entry["ok"] = False
            warnings.append(f"layer {k}: {entry['nan']} NaN and {entry['inf']} Inf values")
        if zero_rows:
            entry["ok"] = False
            warnings.append(f"layer {k}: {zero_rows} of {x.shape[0]} token vectors are all zeros")
        rows.append(entry)
    return rows, warnings


def estimate(
    cfg: RunConfig, lm, layout: StateLayout, hidden: int, sampled: SampledData, device, pad_token_id
) -> dict:
    """The plan ``run`` would make over the whole dataset (from a sample's lengths, repeated, when only a sample
    was tokenized), its bytes, and an ETA from a rate measured here (with the layers the final state adds and the
    fp8 quantization, when asked for)."""
    samples, lengths = sampled.samples, sampled.samples.lengths
    if sampled.basis == "sample":
        lengths = np.resize(lengths, round(len(lengths) * sampled.scale))  # sample i stands at i, i + n, ...
    plan = make_plan(
        lengths.tolist(),
        max_tokens_per_batch=cfg.max_tokens_per_batch,
        max_rows=cfg.max_rows,
        shards=cfg.shards,
    )
    token_bytes = layout.bytes_per_token(hidden, DTYPE_BYTES[cfg.dtype])
    total_bytes = job_bytes(plan, token_bytes)
    topk_bytes = layout.topk_bytes
    tokens_per_s, rate_batch = measure_rate(lm, layout, plan, samples, device, pad_token_id)
    presets = presets_layer_ids(cfg.layers, layout.num_layers)
    return {
        "data": sampled.report.to_json(),
        "basis": {
            "from": sampled.basis,
            "rows_tokenized": sampled.rows_sampled,
            "rows": sampled.rows_total,
        },
        "tokens": plan.num_tokens,
        "samples": plan.num_samples,
        "batches": len(plan.batches),
        "batches_per_shard": [len(plan.for_shard(s)) for s in range(cfg.shards)],
        "padding_waste": plan.padding_waste,
        "bytes_per_token": token_bytes,
        "storage": storage_table(presets, layout, hidden, cfg.dtype, plan),
        "target_topk": None
        if not layout.target_topk
        else {
            "k": layout.target_topk,
            "bytes_per_token": topk_bytes,
            "total_bytes": topk_bytes * plan.num_tokens,
            "share_of_output": topk_bytes / token_bytes,
        },
        "layers_run": layout.layers_run,
        "formats": served_by(layout.layer_ids, layout.final_state, presets),
        "total_bytes": total_bytes,
        "measured_tokens_per_s": tokens_per_s,
        "measured_on": str(device),
        "measured_batch": rate_batch,
        "shards": cfg.shards,
        "eta_s": plan.num_tokens / (tokens_per_s * cfg.shards),
    }


def job_bytes(plan, token_bytes: int) -> int:
    """The bytes of every batch file of ``plan`` at ``token_bytes`` per token, headers included."""
    return sum(
        StateLayout.file_bytes(b.num_tokens, b.rows, token_bytes)
        + HEADER_BYTES_FIXED
        + HEADER_BYTES_PER_SAMPLE * b.rows
        for b in plan.batches
    )


def storage_table(presets: dict, layout: StateLayout, hidden: int, dtype: str, plan) -> list[dict]:
    """Per preset alone, then for what this run captures (their union): ids, slots, bytes per token and for the
    whole job, in the run dtype and in fp8. What one extraction for several drafters costs against one each."""
    storage = (dtype, "float8_e4m3fn")

    def row(name, ids, final_state):
        slots = StateLayout(tuple(ids), layout.num_layers, final_state)
        per_token = {
            s: StateLayout(
                slots.layer_ids, slots.num_layers, final_state, s if s in STORAGE_DTYPES else None
            ).bytes_per_token(hidden, DTYPE_BYTES.get(s, 1))
            for s in storage
        }
        return {
            "name": name,
            "layer_ids": list(ids),
            "final_state": final_state,
            "slots": len(slots.slot_layers),
            "bytes_per_token": per_token,
            "total_bytes": {s: job_bytes(plan, n) for s, n in per_token.items()},
        }

    rows = [row(name, ids, name in FINAL_STATE_PRESETS) for name, ids in presets.items()]
    if (
        len(rows) != 1
        or rows[0]["layer_ids"] != list(layout.layer_ids)
        or rows[0]["final_state"] != layout.final_state
    ):
        rows.append(row("union" if len(rows) > 1 else "this run", layout.layer_ids, layout.final_state))
    return rows
