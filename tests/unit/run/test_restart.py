"""``--restart`` (run/accept.py's ``reset_run``) on a real local output: what it clears, what it refuses, and a
job of several nodes whose first node has already restarted the output onto the new plan."""

import pytest

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.output.ledger import claim_output, job_record, read_job
from hsextract.prepare.plan import make_plan
from hsextract.run.accept import reset_run
from hsextract.run.rundir import RunDir
from hsextract.storage.local import LocalSink

OLD = make_plan([5, 6, 7, 8, 9, 10], max_tokens_per_batch=16, max_rows=2, shards=2)
NEW = make_plan([5, 6, 7, 8, 9, 10, 11, 12], max_tokens_per_batch=16, max_rows=2, shards=2)


def node(tmp_path, rank: int) -> tuple[RunConfig, RunDir]:
    cfg = RunConfig(
        model="m",
        data="d",
        output=str(tmp_path / "out"),
        run_dir=str(tmp_path / f"run{rank}"),
        staging=str(tmp_path / "staging"),
        nodes=2,
        node_rank=rank,
        shards=1,
    )
    run_dir = RunDir(cfg.run_dir)
    run_dir.progress_dir.mkdir(parents=True)
    cfg.staging_dir.mkdir(parents=True)
    return cfg, run_dir


def claimed(sink, plan, run_dir) -> dict:
    job = job_record(plan=plan, nodes=2, run_dir=str(run_dir.root.resolve()), host="node")
    assert claim_output(sink, job) == job
    return job


def test_a_second_node_restarting_after_the_first_keeps_the_new_claim_and_its_batches(tmp_path):
    cfg0, run0 = node(tmp_path, 0)
    cfg1, run1 = node(tmp_path, 1)
    sink = LocalSink(tmp_path / "out")
    job = claimed(sink, NEW, run0)  # node 0 restarted first: the output is the new plan's
    written = NEW.batches[0].key
    sink.put_bytes(written, b"a batch of the new plan")
    reset_run(cfg1, run1, sink, OLD, NEW)
    assert read_job(sink) == job
    assert sink.get_bytes(written) == b"a batch of the new plan"
    assert not run1.progress_dir.exists() and not cfg1.staging_dir.exists()  # its own state is cleared


def test_a_restart_clears_the_old_plans_claim_and_the_batches_the_new_plan_does_not_have(tmp_path):
    cfg0, run0 = node(tmp_path, 0)
    sink = LocalSink(tmp_path / "out")
    claimed(sink, OLD, run0)
    gone = sorted({b.key for b in OLD.batches} - {b.key for b in NEW.batches})
    for b in OLD.batches:
        sink.put_bytes(b.key, b"old")
    reset_run(cfg0, run0, sink, OLD, NEW)
    assert read_job(sink) is None
    assert not [k for k in sink.list_keys("shard-") if k in gone]
    assert not run0.progress_dir.exists()


def test_a_restart_of_an_output_held_by_another_job_is_refused_and_clears_nothing(tmp_path):
    cfg0, run0 = node(tmp_path, 0)
    sink = LocalSink(tmp_path / "out")
    other = make_plan([3, 4], max_tokens_per_batch=16, max_rows=2, shards=2)
    job = claimed(sink, other, RunDir(tmp_path / "elsewhere"))
    with pytest.raises(HsextractError, match="held by another job"):
        reset_run(cfg0, run0, sink, OLD, NEW)
    assert read_job(sink) == job and run0.progress_dir.exists()
