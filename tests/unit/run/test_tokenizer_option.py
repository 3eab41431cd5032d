"""``--tokenizer``: the rows are rendered and tokenized by the tokenizer given instead of the model's own (a tokenizer
trained on other text, whose ids for the same rows differ), its name is part of the plan so a resume with another
is refused as any changed input is, and a tokenizer not there is one line before the model is read. Preparation
(``prepare_run``, what ``run`` does before any weight loads) and ``run`` through click's CliRunner, in this process."""

import dataclasses

import pytest
from click.testing import CliRunner

from hsextract.cli import main
from hsextract.config import RunConfig
from hsextract.demo import build_tokenizer, make_conversations, write_jsonl
from hsextract.errors import HsextractError
from hsextract.prepare.tokenfile import TokenizedSamples
from hsextract.run.preflight import prepare_run
from hsextract.run.rundir import RunDir

ROWS = make_conversations(4, seed=3)


def _ids(tokenizer, row) -> list[int]:
    ids = tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A tokenizer of the model's kind trained on other conversations, with fewer tokens: other ids for a row."""
    folder = tmp_path_factory.mktemp("other-tokenizer")
    return folder, build_tokenizer(folder, corpus=make_conversations(40, seed=7), vocab_size=400)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_model, other_tokenizer):
    """A run prepared with ``--tokenizer`` the other tokenizer."""
    root = tmp_path_factory.mktemp("tokenizer-run")
    cfg = RunConfig(
        model=str(tiny_model),
        tokenizer=str(other_tokenizer[0]),
        data=str(write_jsonl(ROWS, root / "rows.jsonl")),
        output=str(root / "out"),
        run_dir=str(root / "run"),
        staging=str(root / "staging"),
        device="cpu",
        dtype="float32",
        layers="0",
        num_proc=1,
    ).with_model_resolved()
    plan = prepare_run(cfg, echo=lambda *_: None, show_progress=False)
    return cfg, plan


def test_the_rows_are_tokenized_with_the_tokenizer_given(prepared, other_tokenizer, tiny_tokenizer):
    cfg, plan = prepared
    samples = TokenizedSamples.load(RunDir(cfg.run_dir).tokens_file)
    assert len(samples) == len(ROWS)
    for row in ROWS:
        ids = samples.sample(samples.sample_ids.index(row["id"]))[0].tolist()
        assert ids == _ids(other_tokenizer[1], row), row["id"]
        assert ids != _ids(tiny_tokenizer, row), row["id"]  # the model's own would give other ids
    assert plan.fingerprint["tokenizer"] == str(other_tokenizer[0])
    assert RunConfig.load(RunDir(cfg.run_dir).config_file).tokenizer == str(other_tokenizer[0])


def test_a_resume_with_another_tokenizer_is_refused_naming_it_and_restart_prepares_again(
    prepared, tiny_model, tiny_tokenizer, tmp_path
):
    cfg, plan = prepared
    own = tmp_path / "own"
    own.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (own / name).write_bytes(
            (tiny_model / name).read_bytes()
        )  # the model's own tokenizer, named otherwise
    for other, named in ((str(own), f"'{own}'"), (None, "None")):
        again = dataclasses.replace(cfg, tokenizer=other, tokenizer_dir=None).with_model_resolved()
        with pytest.raises(HsextractError, match="holds a different plan") as refused:
            prepare_run(again, echo=lambda *_: None, show_progress=False)
        assert f"tokenizer: '{cfg.tokenizer}' -> {named}" in str(refused.value)
        assert "tokenizer_hash: " in str(refused.value)
    assert prepare_run(cfg, echo=lambda *_: None, show_progress=False).plan_hash == plan.plan_hash  # a resume

    restarted = dataclasses.replace(
        cfg, tokenizer=str(own), tokenizer_dir=None, run_dir=str(tmp_path / "run")
    )
    restarted = dataclasses.replace(restarted, output=str(tmp_path / "out")).with_model_resolved()
    prepare_run(restarted, echo=lambda *_: None, show_progress=False)
    samples = TokenizedSamples.load(RunDir(restarted.run_dir).tokens_file)
    assert samples.sample(samples.sample_ids.index(ROWS[0]["id"]))[0].tolist() == _ids(
        tiny_tokenizer, ROWS[0]
    )


def _run(tmp_path, *options) -> object:
    data = write_jsonl(ROWS[:1], tmp_path / "rows.jsonl")
    args = ["run", "--data", str(data), "--output", str(tmp_path / "out"), "--run-dir", str(tmp_path / "run")]
    return CliRunner().invoke(main, [*args, "--device", "cpu", "--no-progress", *map(str, options)])


def test_a_tokenizer_not_there_is_one_line_before_anything_is_made(
    tiny_model, tmp_path, restored_process_state
):
    result = _run(tmp_path, "--model", tiny_model, "--tokenizer", tmp_path / "no-such-tokenizer")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: --tokenizer {tmp_path / 'no-such-tokenizer'}: no such directory, and not a Hub id of the form "
        "org/name either"
    ], result.stderr
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_folder_without_a_tokenizer_is_refused_before_the_model_is_read(
    tiny_model, tmp_path, restored_process_state
):
    empty = tmp_path / "tok"
    empty.mkdir()
    (empty / "README.md").write_text("no tokenizer here")
    result = _run(tmp_path, "--model", tiny_model, "--tokenizer", empty)
    assert result.exit_code == 2, result.output
    assert f"error: --tokenizer {empty}: has no tokenizer" in result.stderr, result.stderr
    assert "it holds README.md" in result.stderr
    assert not (tmp_path / "run" / "plan.json").exists()


def test_a_tokenizer_revision_pins_a_hub_id_only(tiny_model, tmp_path, other_tokenizer):
    with pytest.raises(HsextractError, match="--tokenizer-revision main pins --tokenizer: give one"):
        RunConfig(model=str(tiny_model), data="x.jsonl", output="o", run_dir="r", tokenizer_revision="main")
    given = RunConfig(
        model=str(tiny_model),
        data="x.jsonl",
        output="o",
        run_dir="r",
        tokenizer=str(other_tokenizer[0]),
        tokenizer_revision="main",
    )
    with pytest.raises(
        HsextractError, match="--tokenizer-revision main: --tokenizer .* is a local directory"
    ):
        given.with_model_resolved()


def test_a_hub_id_tokenizer_resolves_from_the_cache_and_a_typo_names_the_cached_id(
    tiny_model, tmp_path, other_tokenizer, monkeypatch
):
    from support.chat_servers import SNAPSHOT, hub_cache_with

    cache = hub_cache_with(other_tokenizer[0], tmp_path / "hub", "acme/other-tokenizer")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_jsonl(ROWS[:1], tmp_path / "rows.jsonl")
    fields = dict(
        model=str(tiny_model), data=str(data), output=str(tmp_path / "out"), run_dir=str(tmp_path / "run")
    )

    cfg = RunConfig(**fields, tokenizer="acme/other-tokenizer").with_model_resolved()
    assert cfg.tokenizer_path == str(cache / "models--acme--other-tokenizer" / "snapshots" / SNAPSHOT)
    assert cfg.tokenizer_commit == SNAPSHOT and cfg.model_path == str(tiny_model)
    cfg = dataclasses.replace(cfg, staging=str(tmp_path / "staging"), device="cpu", layers="0", num_proc=1)
    fingerprint = prepare_run(cfg, echo=lambda *_: None, show_progress=False).fingerprint
    assert (fingerprint["tokenizer"], fingerprint["tokenizer_revision"]) == ("acme/other-tokenizer", SNAPSHOT)
    with pytest.raises(HsextractError) as e:
        RunConfig(**fields, tokenizer="acme/Other-tokeniser").with_model_resolved()
    assert str(e.value).startswith(
        "--tokenizer acme/Other-tokeniser: no such directory, and the Hub id is not in"
    )
    assert str(e.value).endswith(
        f"; did you mean acme/other-tokenizer (in the Hugging Face cache at {cache})?"
    )


def test_a_model_folder_without_a_tokenizer_runs_with_the_tokenizer_given(
    tiny_model, tmp_path, other_tokenizer
):
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny_model / name).read_bytes())
    data = write_jsonl(ROWS[:1], tmp_path / "rows.jsonl")
    cfg = RunConfig(
        model=str(bare),
        data=str(data),
        output=str(tmp_path / "out"),
        run_dir=str(tmp_path / "run"),
        staging=str(tmp_path / "staging"),
        device="cpu",
        layers="0",
        num_proc=1,
    )
    with pytest.raises(HsextractError, match=f"--model {bare}: has no tokenizer"):
        prepare_run(cfg.with_model_resolved(), echo=lambda *_: None, show_progress=False)
    given = dataclasses.replace(cfg, tokenizer=str(other_tokenizer[0])).with_model_resolved()
    assert len(prepare_run(given, echo=lambda *_: None, show_progress=False).batches) == 1
