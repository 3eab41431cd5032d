"""A model name found nowhere (hub.py): the error names the ids of the Hugging Face cache closest to it, a typo, a
case or a character apart, and the cache they are in; nothing when none is close. Before any weight loads: `run`
through click's CliRunner stops at the options, its run dir never made."""

import pytest
from click.testing import CliRunner

from hsextract.cli import main
from hsextract.errors import HsextractError
from hsextract.hub import cached_ids, closest_ids, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"

CACHED = ["Qwen/Qwen3.6-27B", "Qwen/Qwen3.6-27B-FP8", "acme/tiny-qwen"]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding ``CACHED`` (a config.json each), the machine offline."""
    cache = tmp_path / "hf" / "hub"
    for repo in CACHED:
        entry = cache / f"models--{repo.replace('/', '--')}"
        (entry / "snapshots" / COMMIT).mkdir(parents=True)
        (entry / "snapshots" / COMMIT / "config.json").write_text("{}")
        (entry / "refs").mkdir()
        (entry / "refs" / "main").write_text(COMMIT)
    (cache / "models--acme--no-snapshot" / "blobs").mkdir(parents=True)  # an interrupted download
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_the_cache_lists_the_ids_that_have_a_snapshot(hub_cache):
    assert cached_ids() == sorted(CACHED)


@pytest.mark.parametrize(
    "typed",
    ["Qwen/Qwen3.6-27b", "qwen/qwen3.6-27B", "Qwen/Qwen3.6-27", "Qwen/Qwen3.6-277B", "Qwen/Qwen3.5-27B"],
)
def test_a_mistyped_hub_id_offline_names_the_closest_cached_id(hub_cache, typed):
    with pytest.raises(HsextractError) as e:
        resolve_model(typed)
    message = str(e.value)
    assert message.startswith(
        f"--model {typed}: no such directory, and the Hub id is not in the Hugging Face"
    )
    assert "; did you mean Qwen/Qwen3.6-27B" in message  # the closest first, then any other close one
    assert message.endswith(f" (in the Hugging Face cache at {hub_cache})?") and "tiny-qwen" not in message


def test_a_name_like_no_cached_id_gets_no_suggestion(hub_cache):
    for name in ("acme/not-there", "meta-llama/Llama-3.1-8B", "./no/such/dir"):
        with pytest.raises(HsextractError) as e:
            resolve_model(name)
        assert "did you mean" not in str(e.value), name


def test_a_local_path_that_is_not_there_names_the_cached_id_its_last_parts_spell(hub_cache, tmp_path):
    with pytest.raises(HsextractError) as e:
        resolve_model(str(tmp_path / "models" / "Qwen3.6-27B"))
    assert "no such directory, and not a Hub id" in str(e.value)
    assert "; did you mean Qwen/Qwen3.6-27B" in str(e.value) and str(e.value).endswith(
        f"cache at {hub_cache})?"
    )
    assert closest_ids("/data/acme/tiny-qwen/", CACHED) == ["acme/tiny-qwen"]


def test_run_with_a_mistyped_model_says_it_in_one_line_before_anything_is_made(
    hub_cache, tmp_path, restored_process_state
):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": "a", "text": "hi"}\n')
    args = ["run", "--model", "acme/tiny-qwn", "--data", str(data), "--output", str(tmp_path / "out")]
    result = CliRunner().invoke(main, [*args, "--run-dir", str(tmp_path / "run"), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--model acme/tiny-qwn:" in errors[0], result.stderr
    assert "did you mean acme/tiny-qwen (in the Hugging Face cache" in errors[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()
