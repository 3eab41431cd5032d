"""validation.py: every JSON record read back is checked field by field, and a damaged one is refused naming the
field's path and the value found; the records written today read back equal."""

from __future__ import annotations

import json

import pytest

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.output import Plan
from hsextract.output.ledger import RunInfo
from hsextract.prepare.plan import make_plan
from hsextract.prepare.report import DataReport
from hsextract.run.progress import DamagedProgress, ShardProgress
from hsextract.run.rundir import RunDir


def damaged(record: dict, path: list, value) -> dict:
    record = json.loads(json.dumps(record))
    at = record
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    return record


def test_a_plan_with_a_bad_sample_index_is_refused_naming_its_place():
    plan = make_plan([5, 3, 8, 2], max_tokens_per_batch=16, max_rows=2, shards=2, fingerprint={"a": 1})
    body = plan.to_json()
    assert Plan.from_json(json.dumps(body)) == plan == Plan.from_json(body)
    with pytest.raises(HsextractError, match=r"batches\.1\.4\.0: Input should be a valid integer, got '3'"):
        Plan.from_json(damaged(body, ["batches", 1, 4, 0], "3"), where="plan.json")
    with pytest.raises(HsextractError, match=r"shards: Field required"):
        Plan.from_json({k: v for k, v in body.items() if k != "shards"})


def test_run_info_config_and_report_name_the_bad_field(tmp_path):
    info = RunInfo(
        layer_ids=(0, 3),
        layer_types=("linear_attention", "full_attention"),
        num_layers=8,
        hidden_size=64,
        pad_token_id=0,
        plan_hash="abc",
        file_metadata={"k": "v"},
    )
    assert RunInfo.from_json(info.to_json()) == info
    with pytest.raises(
        HsextractError, match=r"run.json is damaged \(layer_ids\.1: Input should be a valid integer"
    ):
        RunInfo.from_json(damaged(info.to_json(), ["layer_ids", 1], 3.5))

    cfg = RunConfig(model="m", data="d.jsonl", output=str(tmp_path / "o"), run_dir=str(tmp_path / "r"))
    assert RunConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(HsextractError, match=r"max_rows: Input should be a valid integer, got True"):
        RunConfig.from_json(damaged(cfg.to_json(), ["max_rows"], True))

    report = DataReport(
        rows=3,
        kept=2,
        truncated=0,
        skipped_empty=1,
        skipped_malformed=0,
        skipped_too_long=0,
        tokens=9,
        max_length=8,
    )
    assert DataReport.from_json(report.to_json()) == report
    with pytest.raises(HsextractError, match=r"kept: Field required"):
        DataReport.from_json({k: v for k, v in report.to_json().items() if k != "kept"})


def test_a_progress_file_with_a_number_that_is_not_finite_is_damaged(tmp_path):
    path = RunDir(tmp_path).progress_file(0)
    path.parent.mkdir(parents=True)
    path.write_text('{"shard": 0, "tokens_per_s": NaN}')
    with pytest.raises(DamagedProgress, match=r"tokens_per_s: Input should be a finite number"):
        ShardProgress.read(tmp_path, 0)
