"""The real CLI on a model named as on the Hub, rendered as the server renders: ``hsextract run --model org/name``
from the Hugging Face cache with the network off, ``--chat-template`` (Qwen3.6's public template) and
``--chat-template-kwargs``; the ids and loss masks read back equal ``apply_chat_template``'s, the snapshot's commit
and the template options are in the manifest, and a resume with other template arguments is refused by name."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from support.cli import cli_run_args, run_cli
from support.served_rows import CHAT_TEMPLATES, conversations, reference

from hsextract.demo import write_jsonl
from hsextract.output import open_output

pytestmark = pytest.mark.slow

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, model_dir, repo="acme/tiny-qwen"):
    """``model_dir`` laid out as huggingface_hub caches a download of ``repo`` at ``COMMIT``."""
    entry = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model_dir, entry / "snapshots" / COMMIT)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    return root


def test_a_hub_id_from_the_cache_renders_as_the_server_and_reads_back(tmp_path, tiny_model, tiny_tokenizer):
    cache = hub_cache(tmp_path / "hf", tiny_model)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    rows = conversations()
    data = write_jsonl(rows, tmp_path / "rows.jsonl")
    template = CHAT_TEMPLATES / "qwen3_6.jinja"
    kwargs = {"preserve_thinking": True, "enable_thinking": False}
    args = cli_run_args(
        tmp_path,
        "acme/tiny-qwen",
        data,
        layers="1",
        num_proc=1,
        chat_template=template,
        chat_template_kwargs=json.dumps(kwargs),
    )

    result = run_cli(*args, "--no-progress", env=env)

    assert "0 malformed" not in result.stdout and f"{len(rows)} rows: {len(rows)} kept" in result.stdout
    out = open_output(str(tmp_path / "out"))
    for row in rows:
        want_ids, want_mask = reference(tiny_tokenizer, row, kwargs, chat_template=template.read_text())
        sample = out[row["id"]]
        assert sample["input_ids"].tolist() == want_ids, row["id"]
        assert sample["loss_mask"].tolist() == want_mask, row["id"]
    fingerprint = out.manifest["fingerprint"]
    assert fingerprint["model"] == "acme/tiny-qwen" and fingerprint["model_revision"] == COMMIT
    assert fingerprint["chat_template_kwargs"] == kwargs and fingerprint["chat_template_given"] is True

    other = [
        *args[: args.index("--chat-template-kwargs")],
        "--chat-template-kwargs",
        '{"preserve_thinking": false}',
    ]
    other += args[args.index("--chat-template-kwargs") + 2 :]
    refused = run_cli(*other, "--no-progress", env=env, check=False)
    assert refused.returncode != 0
    assert "chat_template_kwargs.preserve_thinking: True -> False" in refused.stdout + refused.stderr

    # The Hub id now names another snapshot (a new commit of the same files): the resume says so.
    entry = cache / "models--acme--tiny-qwen"
    shutil.copytree(entry / "snapshots" / COMMIT, entry / "snapshots" / ("f" * 40))
    (entry / "refs" / "main").write_text("f" * 40)
    refused = run_cli(*args, "--no-progress", env=env, check=False)
    assert refused.returncode != 0
    assert f"model_revision: '{COMMIT}' -> '{'f' * 40}'" in refused.stdout + refused.stderr


def test_a_hub_id_neither_cached_nor_reachable_fails_in_seconds_with_one_line(tmp_path, tiny_model):
    cache = hub_cache(tmp_path / "hf", tiny_model)
    data = write_jsonl(conversations()[:1], tmp_path / "rows.jsonl")
    args = cli_run_args(tmp_path, "acme/not-there", data)

    for env in (
        {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)},
        # Online, with the Hub on a port nothing listens on: the network is refused at once.
        {"HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"},
    ):
        started = time.monotonic()
        r = run_cli(*args, env=env, check=False)
        elapsed = time.monotonic() - started
        assert r.returncode == 2, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "acme/not-there" in errors[0] and "no such directory" in errors[0]
        assert ("offline" in errors[0]) == (env["HF_HUB_OFFLINE"] == "1"), errors[0]
        assert elapsed < 30, elapsed
        assert not (tmp_path / "run").exists()


def test_the_shipped_config_runs_as_its_use_line_says_from_the_cache_offline(tmp_path, tiny_model):
    """``hsextract run --config configs/qwen3.6-27b-dflash.yaml --data ... --output ...``, its model
    (``Qwen/Qwen3.6-27B``) in the Hugging Face cache and the network off; on this CPU machine with one shard."""
    cache = hub_cache(tmp_path / "hf", tiny_model, repo="Qwen/Qwen3.6-27B")
    data = write_jsonl(conversations(), tmp_path / "rows.jsonl")
    config = Path(__file__).parents[2] / "configs" / "qwen3.6-27b-dflash.yaml"

    run_cli(
        "run", "--config", config, "--data", data, "--output", tmp_path / "out", "--run-dir", tmp_path / "run",
        "--staging", tmp_path / "staging", "--device", "cpu", "--shards", "1", "--no-progress",
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)},
    )  # fmt: skip

    out = open_output(str(tmp_path / "out"))
    assert len(out) == len(conversations())
    assert out.manifest["fingerprint"]["model"] == "Qwen/Qwen3.6-27B"
    assert out.manifest["fingerprint"]["model_revision"] == COMMIT


def test_per_turn_rows_through_the_cli_the_reader_and_the_training_dataset(
    tmp_path, tiny_model, tiny_tokenizer
):
    """``--rows per-turn``: each assistant turn is a sample ``<id>#t<k>`` whose ids are ``apply_chat_template`` of
    the messages up to it and whose loss is that turn alone; the reader and the training dataset take them as any."""
    import torch

    from hsextract.training import StatesMapDataset

    rows = conversations()
    template = CHAT_TEMPLATES / "qwen3_6.jinja"
    kwargs = {"enable_thinking": True}
    args = cli_run_args(
        tmp_path,
        tiny_model,
        write_jsonl(rows, tmp_path / "rows.jsonl"),
        layers="1",
        num_proc=1,
        chat_template=template,
        chat_template_kwargs=json.dumps(kwargs),
    )
    run_cli(*args, "--rows", "per-turn", "--no-progress")

    out = open_output(str(tmp_path / "out"))
    assert out.manifest["fingerprint"]["rows"] == "per-turn"
    assert out.manifest["fingerprint"]["share_prefixes"] is True  # the CPU's stock forward shares prefixes
    want = {}
    for row in rows:
        turns = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        for k, i in enumerate(turns, 1):
            turn = {**row, "messages": row["messages"][: i + 1]}
            want[f"{row['id']}#t{k}"] = reference(
                tiny_tokenizer, turn, kwargs, chat_template=template.read_text(), last_turn_only=True
            )
    assert sorted(out.sample_ids()) == sorted(want)
    for sample_id, (ids, mask) in want.items():
        assert out[sample_id]["input_ids"].tolist() == ids, sample_id
        assert out[sample_id]["loss_mask"].tolist() == mask, sample_id
    # Each turn row's states, computed with the shared prefixes once, are its unbatched whole forward's.
    from hsextract.model.load import load_model

    lm = load_model(str(tiny_model), dtype="float32", device="cpu")
    for sample_id, (ids, _) in want.items():
        with torch.inference_mode():
            ref = lm(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0]  # output of layer 1
        torch.testing.assert_close(out[sample_id]["layers"][1], ref, rtol=1e-4, atol=1e-4)
    data = StatesMapDataset(str(tmp_path / "out"), "raw", dtype=torch.float32)
    assert sorted(len(data[i]["input_ids"]) for i in range(len(data))) == sorted(
        len(i) for i, _ in want.values()
    )
