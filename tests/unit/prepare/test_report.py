"""Bad rows through `hsextract run` (in this process, through click's CliRunner): the first of each kind shown on the
console, `--max-bad-rows` stopping before any weight loads, and a source without a usable row refused with advice
that fits what its rows lacked."""

import json

import pytest
from click.testing import CliRunner
from support.cli import TINY_LIMITS, cli_run_args

from hsextract.cli import main
from hsextract.demo import make_conversations
from hsextract.prepare.report import DataReport

pytestmark = pytest.mark.usefixtures("restored_process_state")


def _write(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def _run(tiny_model, data, root, **options):
    args = cli_run_args(root, tiny_model, data, num_proc=1, no_progress=True, **TINY_LIMITS, **options)
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert isinstance(result.exception, SystemExit | None), result.exception  # a message, not a traceback
    return result


def test_the_first_bad_row_of_each_kind_is_shown_and_max_bad_rows_stops_the_run(tiny_model, tmp_path):
    rows = [*make_conversations(3), "not json\n", {"dialog": []}, {"messages": []}]
    data = _write(tmp_path / "d.jsonl", rows)
    result = _run(tiny_model, data, tmp_path, max_bad_rows=1)
    assert result.exit_code == 2, result.output
    assert "6 rows: 3 kept, 1 empty, 2 malformed" in result.stdout
    assert "  first malformed row: row 3 (id 3): line 4 is not valid JSON" in result.stdout
    assert "  first empty row: row 5 (id 5): " in result.stdout
    assert "error: 3 of 6 rows are malformed or empty, more than --max-bad-rows allows (1)" in result.stderr
    assert "row 3 (malformed): line 4 is not valid JSON (Expecting value" in result.stderr
    assert "row 4 (malformed): row has none of the fields" in result.stderr
    assert not (tmp_path / "run" / "plan.json").exists() and not (tmp_path / "out" / "hsextract").exists()
    result = _run(tiny_model, data, tmp_path, max_bad_rows=0.4)
    assert "more than --max-bad-rows allows (0.4 of the rows read, 2.4)" in result.stderr, result.output
    result = _run(tiny_model, data, tmp_path, max_bad_rows="some")
    assert (
        result.exit_code == 2
        and "--max-bad-rows 'some': give a count of rows (100) or a fraction" in result.stderr
    )


@pytest.mark.parametrize(
    ("limit", "refused"), [(None, False), (3, False), (2, True), (0.5, False), (0.49, True), (0, True)]
)
def test_max_bad_rows_allows_up_to_the_count_or_the_fraction(limit, refused):
    report = DataReport(
        rows=6, kept=3, truncated=0, skipped_empty=1, skipped_malformed=2, skipped_too_long=0, tokens=9,
        max_length=10, examples=[{"row": 0, "id": "0", "kind": "malformed", "reason": "r"}],
    )  # fmt: skip
    if refused:
        with pytest.raises(Exception, match="3 of 6 rows are malformed or empty"):
            report.check_bad_rows(limit)
    else:
        report.check_bad_rows(limit)


def test_a_source_of_rows_too_long_to_keep_is_told_to_raise_max_length_or_truncate(tiny_model, tmp_path):
    long_text = {"text": " ".join(["word"] * 400)}
    data = _write(tmp_path / "long.jsonl", [long_text] * 3)
    result = _run(tiny_model, data, tmp_path, too_long="skip")
    assert result.exit_code == 2, result.output
    assert "every row is longer than --max-length 300 with --too-long skip" in result.stderr.lower()
    assert "raise --max-length" in result.stderr and "--too-long truncate" in result.stderr
    assert "Fix the rows" not in result.stderr


def test_a_source_whose_rows_miss_every_field_names_the_reason_once_and_the_columns_option(
    tiny_model, tmp_path
):
    row = {"id": "a", "dialog": [{"role": "user", "content": "hi"}], "messages": None}  # None: Arrow's filler
    data = _write(tmp_path / "wrong.jsonl", [row] * 7)
    result = _run(tiny_model, data, tmp_path)
    assert result.exit_code == 2, result.output
    err = result.stderr
    fields = "'messages', 'conversations', 'input_ids', 'text'"
    assert (
        f"rows 0, 1, 2, 3, 4 (malformed): row has none of the fields {fields} (its fields: 'dialog', 'id')"
        in err
    )
    assert err.count("has none of the fields") == 1
    assert "columns=" in err and "Fix the rows" not in err
    wide = {f"col{i}": i for i in range(9, 0, -1)}
    result = _run(tiny_model, _write(tmp_path / "wide.jsonl", [wide]), tmp_path)
    assert "(its fields: 'col1', 'col2', 'col3', 'col4', 'col5', 'col6' and 3 more)" in result.stderr, (
        result.output
    )


def test_data_mostly_dropped_says_so_with_the_counts_and_points_at_max_bad_rows(
    tiny_model, tiny_tokenizer, tmp_path
):
    from hsextract.config import RunConfig
    from hsextract.run.preflight import tokenize
    from hsextract.run.rundir import RunDir

    rows = [*make_conversations(3), "not json\n", {"dialog": []}, {"messages": []}, {"messages": "x"}]
    data = _write(tmp_path / "d.jsonl", rows)
    cfg = RunConfig(
        model=str(tiny_model), data=str(data), output=str(tmp_path / "o"), run_dir=str(tmp_path / "r"),
        device="cpu", num_proc=1, **TINY_LIMITS,
    )  # fmt: skip
    said = []
    tokenize(cfg, tiny_tokenizer, RunDir(cfg.run_dir), echo=said.append, show_progress=False)
    assert any(
        "most of the data was dropped: 4 of 7 rows" in line and "--max-bad-rows" in line for line in said
    )
    half = DataReport(
        rows=6, kept=3, truncated=0, skipped_empty=1, skipped_malformed=2, skipped_too_long=0, tokens=9,
        max_length=10,
    )  # fmt: skip
    assert half.mostly_dropped() is None  # half is not most
