"""The whole path, in real processes: data -> plan -> 2 worker shards -> batch files -> reader, checked against an
unbatched HF forward with output_hidden_states (the independent reference)."""

import json

import pytest
import torch
from safetensors import safe_open
from support.cli import E2E_LAYERS, TINY_LIMITS, batch_bytes, cli_run_args, run_cli, write_mixed_dataset
from support.output import write_output

from hsextract.output import open_output

pytestmark = pytest.mark.slow

LAYERS = E2E_LAYERS  # conftest.finished_run, shared with the tests that read or damage its output


def hf_forward(lm, ids):
    """HF ``output_hidden_states`` and the last decoder layer's raw output (a forward hook), unbatched."""
    raw = {}
    hook = lm.model.layers[-1].register_forward_hook(
        lambda m, a, o: raw.__setitem__("prenorm", (o[0] if isinstance(o, tuple) else o)[0])
    )
    try:
        with torch.inference_mode():
            hs = lm(ids[None], output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return [h[0] for h in hs], raw["prenorm"]


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def test_reader_states_equal_unbatched_hf_forward(finished_run, tiny_lm, tiny_tokenizer):
    root, data, _, _ = finished_run
    out = open_output(root / "out")
    rows = [json.loads(line) for line in open(data)]
    assert len(out) == len(rows)
    assert out.layer_ids == LAYERS
    lengths = []
    for sample in out:
        ids = sample["input_ids"]
        lengths.append(len(ids))
        with torch.inference_mode():
            ref = tiny_lm(ids[None], output_hidden_states=True).hidden_states
        for k in LAYERS[:-1]:
            torch.testing.assert_close(sample["layers"][k], ref[k + 1][0], rtol=1e-4, atol=1e-4)
        # HF's last entry has the final norm applied; ours is the raw output of the last layer.
        last = LAYERS[-1]
        torch.testing.assert_close(
            tiny_lm.model.norm(sample["layers"][last]), ref[last + 1][0], rtol=1e-4, atol=1e-4
        )
        assert sample["hidden_states"].shape == (len(ids), len(LAYERS) * 64)
        torch.testing.assert_close(sample["hidden_states"][:, 64:128], sample["layers"][LAYERS[1]])
    assert min(lengths) == 1 and max(lengths) >= 6 * 34


def test_pretokenized_rows_keep_ids_and_mask_by_sample_id(finished_run):
    root, data, _, _ = finished_run
    out = open_output(root / "out")
    pretokenized = [row for row in map(json.loads, open(data)) if "input_ids" in row]
    assert pretokenized, "the mixed dataset must hold pre-tokenized rows for this test to check anything"
    for row in pretokenized:
        s = out[row["id"]]
        assert s["input_ids"].tolist() == row["input_ids"]
        assert s["loss_mask"].int().tolist() == row["loss_mask"]


def test_output_has_several_batches_over_two_shards_and_clean_staging(finished_run):
    root, _, result, _ = finished_run
    files = sorted((root / "out").glob("shard-*/*.safetensors"))  # not final_norm.safetensors
    assert {f.parent.name for f in files} == {"shard-00000", "shard-00001"}
    assert len(files) >= 4
    with safe_open(str(files[0]), framework="pt") as f:
        meta = f.metadata()
        assert json.loads(meta["layer_ids"]) == list(LAYERS)
        assert meta["layer_convention"] == "output_of_decoder_layer"
        assert json.loads(meta["hf_output_hidden_states_index"]) == [k + 1 for k in LAYERS]
        assert f.get_slice("hidden_states").get_shape()[1:] == [len(LAYERS), 64]
    assert not any((root / "staging").rglob("*.safetensors"))
    assert "done:" in result.stdout


def test_rerun_of_a_finished_run_recomputes_nothing(finished_run):
    root, _, _, args = finished_run
    before = {p: p.stat().st_mtime_ns for p in (root / "out").rglob("batch-*.safetensors")}
    r = run_cli(*args)
    assert "shards already complete: [0, 1]" in r.stdout
    after = {p: p.stat().st_mtime_ns for p in (root / "out").rglob("batch-*.safetensors")}
    assert before == after


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, tiny_model, tiny_tokenizer):
    """The EAGLE-3 preset (layers 1, 3, 4 and, implied, the final state as a 4th slot) stored in fp8."""
    root = tmp_path_factory.mktemp("e2e-fp8")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer, n_chat=12)
    run_cli(
        *cli_run_args(
            root,
            tiny_model,
            data,
            layers="eagle3",
            storage_dtype="float8_e4m3fn",
            shards=1,
            **TINY_LIMITS,
            num_proc=1,
            no_progress=True,
        )
    )
    return root / "out"


def test_fp8_storage_is_within_fp8_error_of_hf_and_raw_values_come_on_request(fp8_run, tiny_lm):
    files = sorted(fp8_run.rglob("batch-*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as f:
        assert f.get_slice("hidden_states").get_dtype() == "F8_E4M3"
        tokens = f.get_slice("hidden_states").get_shape()[0]
        assert f.get_slice("hidden_states").get_shape() == [tokens, 4, 64]
        assert f.get_slice("hidden_states_scale").get_shape() == [tokens, 4]
        assert json.loads(f.metadata()["slot_layer_ids"]) == [1, 3, 4, 7]
    out = open_output(fp8_run, dtype=torch.float32)
    got: dict = {k: [] for k in ("final", "prenorm", 1, 3, 4)}
    want: dict = {k: [] for k in got}
    for sample in out:
        hs, prenorm = hf_forward(tiny_lm, sample["input_ids"])
        for k in (1, 3, 4):
            got[k].append(sample["layers"][k])
            want[k].append(hs[k + 1])
        got["final"].append(sample["final_hidden_state"])
        want["final"].append(hs[-1])
        got["prenorm"].append(sample["final_hidden_state_prenorm"])
        want["prenorm"].append(prenorm)
    for k in got:
        a, b = torch.cat(got[k]), torch.cat(want[k])
        assert rel_l2(a, b) < 0.04, k  # fp8 e4m3 with a scale per vector: ~2.6% measured
        assert torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min() > 0.998, k
    # Raw fp8 and scales on request; the default is their bfloat16 dequantization.
    raw = open_output(fp8_run, dequantize=False)
    default = open_output(fp8_run)
    a, b = next(iter(raw)), next(iter(default))
    assert a["layers"][3].dtype == torch.float8_e4m3fn and a["scales"][3].dtype == torch.float32
    assert torch.equal((a["layers"][3].float() * a["scales"][3][:, None]).bfloat16(), b["layers"][3])
    assert b["hidden_states"].dtype == torch.bfloat16 and b["hidden_states"].shape[1] == 3 * 64
    assert torch.equal(a["final_hidden_state"], b["final_hidden_state"])


def test_a_replaced_final_norm_is_refused_by_the_reader_and_named_by_verify(fp8_run):
    """final_norm.safetensors is covered by the manifest: a norm weight changed after the run would silently shift
    every normed final state, so the reader refuses it and ``verify`` names it."""
    from safetensors.torch import load, save

    from hsextract.errors import CorruptOutputError
    from hsextract.output import verify_output

    path = fp8_run / "final_norm.safetensors"
    manifest = json.loads((fp8_run / "manifest.json").read_text())
    assert (
        manifest["final_state"]["norm"]["xxh3"]
        and manifest["final_state"]["norm"]["size"] == path.stat().st_size
    )
    original = path.read_bytes()
    tensors = load(original)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    # A different norm, same shape, same metadata (Qwen3.5 stores w of `1 + w`, zeros in a fresh model: add to it).
    tensors["weight"] = tensors["weight"] + 0.25
    replaced = save(tensors, metadata=meta)
    assert replaced != original and len(replaced) == len(original)
    try:
        path.write_bytes(replaced)
        with pytest.raises(CorruptOutputError, match="final_norm.safetensors: is .* the manifest recorded"):
            open_output(fp8_run)
        report = verify_output(str(fp8_run), show_progress=False)
        assert [e.key for e in report.bad] == ["final_norm.safetensors"], report.as_dict()
        assert next(iter(open_output(fp8_run, verify=False)))["final_hidden_state"] is not None
        path.unlink()
        with pytest.raises(CorruptOutputError, match="final_norm.safetensors: does not exist"):
            open_output(fp8_run)
    finally:
        path.write_bytes(original)
    assert verify_output(str(fp8_run), show_progress=False).ok


def test_an_output_written_in_process_is_the_clis_byte_for_byte(finished_run, tiny_model, tmp_path):
    """support/output.py's output (conftest.written_output, which unit tests read and damage) is what the CLI
    writes from the same data and options: every batch file and the manifest."""
    root, data, _, _ = finished_run
    out = write_output(tmp_path, tiny_model, data)
    assert batch_bytes(out) == batch_bytes(root / "out")
    assert (out / "manifest.json").read_bytes() == (root / "out" / "manifest.json").read_bytes()


def test_text_status_of_a_finished_run_shows_average_rate_elapsed_and_the_data_report(finished_run):
    """Finished shards showed tok/s 0 and a blank ETA, and the text had no data report (the page and --json did)."""
    import re

    from click.testing import CliRunner

    from hsextract.cli import main

    root, data, _, _ = finished_run
    out = CliRunner().invoke(main, ["status", str(root / "run")], terminal_width=200).output
    done_rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+done\s", line)]
    assert len(done_rows) == 2, out
    from hsextract.run.progress import ShardProgress

    for line in done_rows:
        rate = int(line.split()[4].replace(",", ""))
        assert rate > 0 and re.search(r"took \d+m\d+s", line), line
        saved = ShardProgress.load(root / "run", int(line.split()[0])).tokens_per_s  # the rate the bar showed
        assert rate == round(saved), (line, saved)
    assert re.search(r"^data: \d+ rows: \d+ kept", out, re.M), out
    assert f"({data}): " in out, out  # the source's own line
