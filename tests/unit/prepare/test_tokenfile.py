"""prepare/tokenfile.py: the token file proves itself. An id edited in the run dir's token file (a hard link into
the token cache) is found when the file is mapped; preparation re-tokenizes it from its rows, by the resume and
by --restart, and no id outside the model's vocabulary reaches a worker."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
from support.cli import TINY_LIMITS, write_mixed_dataset

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.prepare.tokenfile import TokenizedSamples
from hsextract.run.preflight import prepare_run
from hsextract.run.rundir import RunDir


def edit_in_place(path, tensor: str, index: int, value) -> None:
    """One element of ``tensor`` in the token file at ``path`` overwritten where it lies (every hard link sees it)."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[tensor]
        dtype = np.dtype({"I32": np.int32, "U8": np.uint8, "I64": np.int64}[info["dtype"]])
        f.seek(8 + size + info["data_offsets"][0] + index * dtype.itemsize)
        f.write(np.array([value], dtype=dtype).tobytes())


def samples():
    return TokenizedSamples(
        sample_ids=["a", "b"], input_ids=[5, 6, 7], loss_mask=[0, 1, 1], offsets=[0, 1, 3]
    )


@pytest.mark.parametrize(
    ("tensor", "index", "value"),
    [("input_ids", 1, 10**6), ("loss_mask", 0, 1), ("offsets", 1, 2), ("sample_ids_json", 2, ord("z"))],
)
def test_any_edited_byte_of_a_token_file_is_refused_when_mapped(tmp_path, tensor, index, value):
    path = samples().save(tmp_path / "tokens.safetensors")
    assert TokenizedSamples.load(path).input_ids.tolist() == [5, 6, 7]
    edit_in_place(path, tensor, index, value)
    with pytest.raises(HsextractError, match=f"token file {path} is damaged: its data does not match"):
        TokenizedSamples.load(path)


def test_an_edited_header_or_a_file_without_a_checksum_is_refused(tmp_path):
    path = samples().save(tmp_path / "tokens.safetensors")
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"shape":[3]', b'"shape":[2]', 1))
    with pytest.raises(HsextractError, match="its header does not match its checksum"):
        TokenizedSamples.load(path)
    path.write_bytes(raw.replace(b'"data_xxh3"', b'"data_xxhX"', 1))
    with pytest.raises(HsextractError, match="carries no checksum of its content"):
        TokenizedSamples.load(path)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_model, tiny_tokenizer):
    root = tmp_path_factory.mktemp("prepared")
    data = write_mixed_dataset(root / "data.jsonl", tiny_tokenizer, n_chat=6)
    cfg = RunConfig(
        model=str(tiny_model),
        data=str(data),
        output=str(root / "out"),
        run_dir=str(root / "run"),
        staging=str(root / "staging"),
        device="cpu",
        dtype="float32",
        layers="0",
        num_proc=1,
        **TINY_LIMITS,
    )
    prepare_run(cfg, echo=lambda *_: None, show_progress=False)
    return cfg


def test_an_out_of_vocabulary_id_in_the_run_dirs_token_file_is_re_tokenized_by_resume_and_restart(
    prepared, tiny_model, caplog
):
    cfg = prepared
    run_dir = RunDir(cfg.run_dir)
    want = TokenizedSamples.load(run_dir.tokens_file)
    want_ids = np.array(want.input_ids)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    for restart in (False, True):
        (cache,) = run_dir.cache_dir.glob("tokens-*.safetensors")
        assert (
            cache.stat().st_ino == run_dir.tokens_file.stat().st_ino
        )  # the run dir's is a link to the cache
        edit_in_place(run_dir.tokens_file, "input_ids", 3, vocab + 5)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            prepare_run(cfg, restart=restart, echo=lambda *_: None, show_progress=False)
        assert f"token file {cache} is damaged: its data does not match its checksum" in caplog.text
        assert "tokenizing its rows again" in caplog.text
        again = TokenizedSamples.load(run_dir.tokens_file)  # what a worker maps
        assert np.array_equal(again.input_ids, want_ids) and again.sample_ids == want.sample_ids


def test_ids_outside_the_models_vocabulary_never_reach_a_worker(prepared, tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    run_dir = RunDir(prepared.run_dir)
    top = int(TokenizedSamples.load(run_dir.tokens_file).input_ids.max())
    config["vocab_size"] = top  # the largest id the data holds is now one too many
    (model / "config.json").write_text(json.dumps(config))
    cfg = RunConfig(
        **{
            **prepared.to_json(),
            "model": str(model),
            "run_dir": str(tmp_path / "run"),
            "output": str(tmp_path / "o"),
        }
    )
    with pytest.raises(
        HsextractError, match=f"holds token id {top}, outside the model's vocabulary of {top} ids"
    ):
        prepare_run(cfg, echo=lambda *_: None, show_progress=False)
