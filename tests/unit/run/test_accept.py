"""`--restart` of a finished output: refused without --yes (a question on a terminal), nothing changed; with the
user's yes the old job's manifest goes. `hsextract run` in this process through click's CliRunner."""

import pytest
from click.testing import CliRunner
from support.cli import TINY_LIMITS, cli_run_args, write_mixed_dataset
from support.output import write_output

from hsextract.cli import main
from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.run.preflight import prepare_run

pytestmark = pytest.mark.usefixtures("restored_process_state")


def test_restart_of_a_finished_output_asks_first_and_deletes_only_when_told(
    tiny_model, tiny_tokenizer, tmp_path
):
    data = write_mixed_dataset(tmp_path / "data.jsonl", tiny_tokenizer, n_chat=4)
    out = write_output(tmp_path, tiny_model, data, layers="0")
    manifest = (out / "manifest.json").read_bytes()
    args = cli_run_args(
        tmp_path, tiny_model, data, layers="0", shards=2, num_proc=1, no_progress=True, **TINY_LIMITS
    )
    shorter = [str(a) for a in args] + ["--max-length", "200", "--restart"]
    result = CliRunner().invoke(main, shorter)  # stdin is not a terminal: nobody to ask
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    assert (
        f"--restart would delete the finished output {out}; nothing was changed. Add --yes" in result.stderr
    )
    assert (out / "manifest.json").read_bytes() == manifest

    cfg = RunConfig.load(tmp_path / "run" / "config.json")
    asked = []
    changed = RunConfig(**{**cfg.to_json(), "max_length": 200})
    with pytest.raises(HsextractError, match="would delete the finished output"):
        prepare_run(changed, restart=True, show_progress=False, echo=lambda *_: None, confirm=asked.append)
    assert asked and "--restart deletes the finished output" in asked[0] and (out / "manifest.json").exists()
    prepare_run(changed, restart=True, show_progress=False, echo=lambda *_: None, confirm=lambda q: True)
    assert not (out / "manifest.json").exists()  # the new plan's job now holds the output
