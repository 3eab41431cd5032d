"""Exports of an output of several presets, through `hsextract export` (click's CliRunner, in this process): a
trainer's own preset is taken, a format that serves any drafter asks for --layers, and the `train with:` lines
name the layer ids where the trainer's config takes them, with the trainer's installed command."""

import pytest
from click.testing import CliRunner
from support.cli import write_mixed_dataset
from support.output import write_output

from hsextract.cli import main

N = 8  # the tiny model's layers
EAGLE3 = [1, N // 2 - 1, N - 4]  # FACTS.md: EAGLE-3's default, output-of-layer ids
DFLASH2 = [1, 2, 3, 4, 5]  # 5 ids ending at N-3, round(N / 4.5) = 2 apart, clipped at 1: all of 1..5 here


@pytest.fixture(scope="module")
def union(tmp_path_factory, tiny_model, tiny_tokenizer):
    root = tmp_path_factory.mktemp("union")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer, n_chat=6)
    return write_output(root, tiny_model, data, layers="dflash2,eagle3", shards=1)


def _export(union, dest, *args):
    result = CliRunner().invoke(
        main, ["export", str(union), str(dest), "--num-proc", "1", "--no-progress", *args]
    )
    assert isinstance(result.exception, SystemExit | None), result.exception
    return result


def test_a_format_for_any_drafter_asks_for_layers_on_the_command_line(union, tmp_path):
    for fmt in ("speculators", "modelopt"):
        result = _export(union, tmp_path / fmt, "--format", fmt)
        assert result.exit_code == 2, result.output
        assert "several presets (dflash2, eagle3)" in result.stderr
        assert "--layers dflash2 on `hsextract export`" in result.stderr, result.stderr
        assert not (tmp_path / fmt).exists()


def test_train_with_names_the_layer_ids_where_the_trainer_takes_them(union, tmp_path):
    result = _export(union, tmp_path / "sf2", "--format", "specforge-dflash2")
    assert result.exit_code == 0, result.output
    compact = ",".join(map(str, DFLASH2))  # one shell word
    expected = (
        f'layer ids {DFLASH2}: draft model config: "dflash_config": {{"target_layer_ids": [{compact}]}}'
    )
    assert expected in result.stdout, result.stdout
    # The installed command, and where the recipe it names comes from (the package ships none).
    assert "train with: specforge train --config examples/configs/" in result.stdout
    assert "is sgl-project/SpecForge's (the package ships none)" in result.stdout
    result = _export(union, tmp_path / "spec", "--format", "speculators", "--layers", "eagle3")
    assert result.exit_code == 0, result.output
    vllm = [k + 1 for k in EAGLE3]  # speculators counts the input of layer k
    assert "train with: speculators train --verifier-name-or-path" in result.stdout  # not scripts/train.py
    assert f"--target-layer-ids {' '.join(map(str, vllm))}" in result.stdout
    assert f"  layer ids {vllm}: --target-layer-ids" in result.stdout
    result = _export(union, tmp_path / "mo", "--format", "modelopt", "--layers", "eagle3")
    assert result.exit_code == 0 and "of a NVIDIA/Model-Optimizer checkout" in result.stdout, result.output


def test_a_sharded_cache_shorter_than_samples_skips_them_with_a_count(union, tmp_path):
    """The sample index written at finalize holds nemo-dspark's verdicts for no seq_length: a given one gets its
    own (was: a RuntimeError padding a 300-token sample to 16)."""
    result = _export(
        union, tmp_path / "nemo", "--format", "nemo-dspark", "--layers", "dflash2", "--seq-length", "16"
    )
    assert result.exit_code == 0, result.output + result.stderr
    line = next(x for x in result.output.splitlines() if x.startswith("exported "))
    kept, total, skipped = (int(w) for w in (line.split()[1], line.split()[3], line.split(";")[1].split()[0]))
    assert 0 < kept < total and kept + skipped == total and "longer than the cache's seq_length 16" in line


def test_a_manifest_vocabulary_unlike_the_runs_is_named_with_its_fix_before_anything_is_written(
    union, tmp_path
):
    import json
    import shutil

    out = shutil.copytree(union, tmp_path / "out")
    manifest = json.loads((out / "manifest.json").read_text())
    real = manifest["vocab_size"]
    (out / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 7}))
    for extra in ((), ("--target-vocab-size", "7"), ("--target-vocab-size", str(real))):
        result = _export(
            out,
            tmp_path / "dest",
            "--format",
            "specforge-dflash",
            "--layers",
            "dflash2",
            "--draft-vocab",
            "5",
            *extra,
        )
        assert result.exit_code == 2 and not (tmp_path / "dest").exists()
        assert f"manifest records a vocabulary of 7 tokens, its hsextract/run.json {real}" in result.stderr
        assert f"`hsextract finalize {out}` writes it again" in result.stderr
    verify = CliRunner().invoke(main, ["verify", str(out)])
    assert (
        verify.exit_code != 0
        and f"records vocab_size 7, the output's run.json {real}" in verify.output + verify.stderr
    )
    assert CliRunner().invoke(main, ["finalize", str(out)]).exit_code == 0
    result = _export(
        out, tmp_path / "dest", "--format", "specforge-dflash", "--layers", "dflash2", "--draft-vocab", "5"
    )
    assert result.exit_code == 0, result.stderr
