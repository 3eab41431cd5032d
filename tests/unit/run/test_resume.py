"""What a restarted shard keeps of its staging (run/resume.py's ``recover_staging``): only complete files of
this plan's own batches whose bytes match their writer's checksums, each with the CRC32 of those bytes;
everything else is deleted (and so recomputed). Staged files here are real batch files
(conftest.written_output)."""

import json
import shutil
import zlib

from support.damage import flip_in_states, truncate_half

from hsextract.output import BatchSpec, Plan
from hsextract.run.resume import recover_staging


def test_staging_keeps_exactly_the_complete_undone_files_of_this_plan(written_output, tmp_path):
    plan = Plan.from_json(json.loads((written_output / "hsextract" / "plan.json").read_text()))
    batches = plan.for_shard(0)
    by_key = {b.key: b for b in batches}
    keys = [b.key for b in batches]
    assert len(keys) >= 6
    staging = tmp_path / "staging"
    staging.mkdir()
    for key in keys[:5]:
        shutil.copy(written_output / key, staging)
    name = lambda key: key.split("/")[1]  # noqa: E731
    kept, done, flipped, cut = keys[0], keys[1], keys[2], keys[3]
    flip_in_states(staging / name(flipped))
    truncate_half(staging / name(cut))
    # Batch 4's bytes under the name of a batch not staged: its header names another batch.
    (staging / name(keys[4])).rename(staging / name(keys[5]))
    (staging / f"{name(keys[4])}.tmp-123").write_bytes(b"half a write")
    (staging / "batch-999999.safetensors").write_bytes(b"not in the plan")
    other_plan = tmp_path / "other.safetensors"
    shutil.copy(written_output / kept, other_plan)

    pending = recover_staging(staging, 0, {done}, by_key, plan.plan_hash)
    assert pending == {kept: zlib.crc32((written_output / kept).read_bytes())}
    assert sorted(p.name for p in staging.iterdir()) == [name(kept)]

    # The same file staged for another plan is not this run's to upload.
    shutil.copy(other_plan, staging / name(kept))
    assert recover_staging(staging, 0, set(), by_key, "another-plan-hash") == {}
    assert not any(staging.iterdir())


def test_a_staged_copy_of_a_batch_recorded_done_is_deleted_not_uploaded(tmp_path, caplog):
    """A crash between a batch's completion record and the deletion of its staged file leaves the copy: the batch
    is done, so the copy goes without being read (its bytes here are no batch file at all)."""
    done, todo = BatchSpec(1, 0, (0,), 4, 4), BatchSpec(2, 0, (1,), 4, 4)
    staging = tmp_path / "shard-00000"
    staging.mkdir()
    for batch in (done, todo):
        (staging / batch.key.split("/")[1]).write_bytes(b"not a batch file")
    by_key = {b.key: b for b in (done, todo)}

    with caplog.at_level("INFO", logger="hsextract.run.resume"):
        pending = recover_staging(staging, 0, {done.key}, by_key, "0123456789abcdef")

    assert pending == {} and list(staging.iterdir()) == []
    discarded = [r.getMessage() for r in caplog.records if "discarded" in r.getMessage()]
    assert len(discarded) == 1 and "batch-000002" in discarded[0], "the done copy is deleted unread"
