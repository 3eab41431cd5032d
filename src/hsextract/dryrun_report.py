"""The dry run's report as text: the layer map, the proofs, the health, the storage table and the estimate."""

from __future__ import annotations

import json

from hsextract.prepare.report import DataReport
from hsextract.run.progress import format_bytes, format_duration
from hsextract.training.schemas import served_lines


def storage_lines(rows: list[dict]) -> list[str]:
    """The storage table: each preset alone, then the union this run captures."""
    kinds = list(rows[0]["bytes_per_token"])
    lines = [f"storage per token and for the job ({' | '.join(kinds)}):"]
    for r in rows:
        ids = ", ".join(map(str, r["layer_ids"])) + (" + final state" if r["final_state"] else "")
        per_token = " | ".join(f"{r['bytes_per_token'][k]:,} B" for k in kinds)
        total = " | ".join(format_bytes(r["total_bytes"][k]) for k in kinds)
        lines.append(f"  {r['name']:<9}[{ids}] {r['slots']} slots: {per_token}; {total}")
    return lines


def format_report(report: dict) -> str:
    lines = [f"Layer map for {report['model']} ({report['num_layers']} decoder layers)"]
    lines.append(
        f"{'id':>4}  {'type':<17}{'captures':<40}{'HF idx':>7}{'vLLM id':>8}  "
        f"{'err vs HF':>10}{'vs nbrs':>9}  {'mean':>8}{'std':>8}{'absmax':>8}{'nan':>5}{'zero':>5}  ok"
    )
    fp8 = report["proof"].get("fp8_tolerance") is not None
    if fp8:
        lines[-1] = lines[-1][:-4] + f"{'fp8 err':>9}{'fp8 cos':>9}  ok"
    for e in report["layers"]:
        fp8_cols = f"{e['fp8_rel_err']:>9.2e}{e['fp8_cos_min']:>9.5f}" if fp8 else ""
        lines.append(
            f"{e['layer_id']:>4}  {e['layer_type']:<17}{e['captures']:<40}{e['hf_output_hidden_states_index']:>7}"
            f"{e['vllm_input_of_layer_id']:>8}  {e['rel_err_vs_hf']:>10.2e}{e['rel_err_vs_neighbour_layers']:>9.2e}  "
            f"{e['mean']:>8.3f}{e['std']:>8.3f}{e['absmax']:>8.2f}{e['nan']:>5}{e['zero_tokens']:>5}{fp8_cols}  "
            f"{'yes' if e['ok'] else 'NO'}"
        )
    chat = report.get("chat")
    if chat:
        commit = f" (snapshot {report['model_commit'][:12]})" if report.get("model_commit") else ""
        tokenizer = "the model's own"
        if report.get("tokenizer"):
            at = f" (snapshot {report['tokenizer_commit'][:12]})" if report.get("tokenizer_commit") else ""
            tokenizer = f"--tokenizer {report['tokenizer']}, files {report['tokenizer_dir']}{at}"
        lines.append(
            f"model files: {report.get('model_dir', report['model'])}{commit}; tokenizer: {tokenizer}; "
            f"chat template: {chat['template']}"
            + (f", arguments {json.dumps(chat['kwargs'])}" if chat["kwargs"] else "")
        )
        lines.append("first sample as the target sees it, «loss-masked tokens» (what the drafter learns):")
        lines.append(chat["first_sample"])
    p = report["proof"]
    compute = report.get("compute", "bf16")
    lines.append(
        f"proof: {p['samples']} samples, {p['tokens']} tokens, {p['dtype']}, relative tolerance {p['tolerance']:.0e}"
        + (f"; fp8 storage within {p['fp8_tolerance']:.0e} of the unquantized capture" if fp8 else "")
        + (
            "; the HF reference runs the capture's own fp8 layer forwards (the fp8 recipe check proves them)"
            if compute.startswith("fp8")
            else ""
        )
    )
    lines.append(
        f"compute: {compute}"
        + {
            "fp8": " (the served FP8 recipe: e4m3 weights in 128x128 blocks, activations per token per 128 columns, "
            "block-scaled GEMMs)",
            "fp8-emulated": " (the served FP8 recipe, emulated in float32: no block-scaled fp8 GEMMs here)",
        }.get(compute, f" (no fp8: the linears run in {p['dtype']})")
    )
    lines += fp8_check_lines(report.get("fp8_check"))
    f = report.get("final_state")
    if f:
        lines.append(
            f"final state: layer {f['layer']} stored before the norm; the reader's final_hidden_state applies "
            f"RMSNorm (eps {f['eps']:g}, scale {'1 + weight' if f['rule'] == 'one_plus_weight' else 'weight'}, "
            f"read from the model's norm) = HF output_hidden_states[-1], proven in the row above"
        )
    t = report.get("target_topk")
    if t:
        lines.append(
            f"target top-k: {t['tokens']} tokens against HF's unbatched logits.log_softmax(-1).topk: relative "
            f"error {t['rel_err_vs_hf']:.2e} (tolerance {t['tolerance']:.0e}), max |diff| {t['max_abs_err']:.2e}, "
            f"{t['same_id_sets']} tokens with the same id set, {t['ids_outside']} stored ids outside HF's top k "
            f"beyond ties: {'yes' if t['ok'] else 'NO'}"
        )
    est = report["estimate"]
    basis = est.get("basis", {})
    if basis.get("from") == "sample":
        lines.append(
            f"estimate from a sample: the first rows of each source, {basis['rows_tokenized']:,} of "
            f"{basis['rows']:,} rows tokenized, their lengths repeated to the data's size (the run tokenizes all)"
        )
    lines += [
        f"data: {est['samples']} samples, {est['tokens']:,} tokens ({est['data']['skipped_empty']} empty, "
        f"{est['data']['skipped_malformed']} malformed, {est['data']['truncated']} truncated, "
        f"{est['data']['skipped_too_long']} too long skipped)",
        *(
            f"  {line}"
            for line in (
                DataReport.from_json(est["data"]).source_lines()
                if len(est["data"].get("sources", [])) > 1
                else []
            )
        ),
        f"plan: {est['batches']} batches, per shard {est['batches_per_shard']}, padding waste {100 * est['padding_waste']:.2f}%",
        f"output: {est['bytes_per_token']:,} bytes/token ({report.get('storage_dtype', '')}), "
        f"{format_bytes(est['total_bytes'])} in total; the forward runs layers 0..{est['layers_run'] - 1}",
        *storage_lines(est["storage"]),
        *served_lines(est.get("formats") or {}),
        *(
            [
                f"target top-{est['target_topk']['k']}: +{est['target_topk']['bytes_per_token']:,} bytes/token "
                f"(ids int32 + log-probs float32, every token), {format_bytes(est['target_topk']['total_bytes'])} "
                f"for the job ({100 * est['target_topk']['share_of_output']:.1f}% of the output)"
            ]
            if est.get("target_topk")
            else []
        ),
        f"speed: {est['measured_tokens_per_s']:,.0f} tokens/s measured on {est['measured_on']} "
        f"(a {est['measured_batch']['rows']} x {est['measured_batch']['padded_length']} batch of the plan); "
        f"ETA with {est['shards']} shard(s): {format_duration(est['eta_s'])}",
    ]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    for w in report["warnings"]:
        lines.append(f"WARNING: {w}")
    lines.append(
        "dry run passed: the captured layers are the intended ones"
        if report["ok"]
        else "dry run FAILED: do not start the run until the warnings above are understood"
    )
    return "\n".join(lines)


def fp8_check_lines(check: dict | None) -> list[str]:
    """The fp8 compute's proof: per layer the capture's distance from the served recipe, from the nearest of its
    wrong variants and from the bf16 target's states."""
    if not check:
        return []
    loaded = (
        f"{check['linears']} fp8 linears, "
        + (
            "weights and scales identical to the checkpoint's files"
            if not check["mismatched_linears"]
            else f"{len(check['mismatched_linears'])} NOT as in the checkpoint's files"
        )
        if check["checked_against_files"]
        else f"{check['linears']} linears quantized on load"
    )
    lines = [
        f"fp8 recipe check: {check['samples']} samples, {check['tokens']} tokens; {loaded}; relative L2 distance "
        f"of the states from each reference (bf16 target: {check['bf16_target']})",
        f"{'layer':>7}{'recipe':>10}  {'nearest wrong variant':<38}{'bf16 target':>12}  nearest the recipe",
    ]
    for layer, dist in check["layers"].items():
        wrong = {v: d for v, d in dist.items() if v != "recipe"}
        nearest = min(wrong, key=wrong.get)
        lines.append(
            f"{layer:>7}{dist['recipe']:>10.2e}  {f'{wrong[nearest]:.2e} ({nearest})':<38}"
            f"{dist['bf16 weights']:>12.2e}  {'yes' if dist['recipe'] < wrong[nearest] else 'NO'}"
        )
    return lines
