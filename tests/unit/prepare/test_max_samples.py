"""``--max-samples N``: a quick trial of the whole job on the first N rows of the mix (after each source's own
selection), part of the plan. Prepared in this process by the run's own preparation (no workers); the CLI's
refusals through click's CliRunner. A dry run's figures with it: tests/scenarios/test_dryrun.py."""

import json

import pytest
from click.testing import CliRunner
from support.cli import TINY_LIMITS, cli_run_args

from hsextract.cli import main
from hsextract.config import RunConfig
from hsextract.demo import make_conversations
from hsextract.prepare.tokenfile import TokenizedSamples
from hsextract.run.preflight import prepare_run
from hsextract.run.rundir import RunDir


def _data(tmp_path):
    """Two sources: 5 chat rows (ids c0..c4) and 6 (t0..t5), the second given limit=4 (its own selection)."""
    paths = []
    for name, n in (("chat", 5), ("more", 6)):
        rows = [{**row, "id": f"{name[0]}{i}"} for i, row in enumerate(make_conversations(n, seed=len(name)))]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return (f"{paths[0]}?name=chat", f"{paths[1]}?name=more&limit=4")


def _cfg(tiny_model, tmp_path, data, **options) -> RunConfig:
    return RunConfig(
        model=str(tiny_model),
        data=data,
        output=str(tmp_path / "out"),
        run_dir=str(tmp_path / "run"),
        staging=str(tmp_path / "staging"),
        device="cpu",
        dtype="float32",
        num_proc=1,
        **TINY_LIMITS,
        **options,
    )


def _planned_ids(tmp_path) -> list[str]:
    return sorted(TokenizedSamples.load(RunDir(tmp_path / "run").tokens_file).sample_ids)


@pytest.mark.parametrize(
    ("limit", "expected"), [(3, ["chat/c0", "chat/c1", "chat/c2"]), (7, None), (50, None)]
)
def test_max_samples_plans_the_first_rows_of_the_mix(tiny_model, tmp_path, limit, expected):
    data = _data(tmp_path)
    everything = [f"chat/c{i}" for i in range(5)] + [
        f"more/m{i}" for i in range(4)
    ]  # limit=4 of 'more' first
    plan = prepare_run(
        _cfg(tiny_model, tmp_path, data, max_samples=limit), echo=lambda *_: None, show_progress=False
    )
    assert _planned_ids(tmp_path) == sorted(expected or everything[:limit])
    assert plan.num_samples == min(limit, len(everything))
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["rows"] == min(limit, len(everything))


def test_another_max_samples_is_another_plan_and_a_bad_value_is_refused(tiny_model, tmp_path):
    data = _data(tmp_path)
    prepare_run(_cfg(tiny_model, tmp_path, data, max_samples=3), echo=lambda *_: None, show_progress=False)
    args = [
        str(a) for a in cli_run_args(tmp_path, tiny_model, None, num_proc=1, no_progress=True, **TINY_LIMITS)
    ]
    result = CliRunner().invoke(main, [*args, "--max-samples", "4", "--data", data[0], "--data", data[1]])
    assert result.exit_code == 2, result.output
    assert "max_samples: 3 -> 4" in result.stderr, result.stderr
    result = CliRunner().invoke(main, [*args, "--max-samples", "0", "--data", data[0]])
    assert result.exit_code == 2 and "--max-samples must be at least 1, got 0" in result.stderr, result.output
