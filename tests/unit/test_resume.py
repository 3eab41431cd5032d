"""What a shard has left when its worker starts: staged files against the output's completion records."""

from __future__ import annotations

from hsextract.prepare.plan import BatchSpec
from hsextract.run.resume import recover_staging


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
