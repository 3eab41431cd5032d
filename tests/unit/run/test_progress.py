"""A shard's progress file (run/progress.py): what a worker saves reads back as it was; a file that holds
anything else is named with what is wrong (``read``) or taken as none (``load``). The rate history:
tests/unit/status/test_status.py."""

import json

import pytest

from hsextract.run.progress import DamagedProgress, ShardProgress, format_duration
from hsextract.run.rundir import RunDir


def test_a_saved_progress_reads_back_field_for_field(tmp_path):
    p = ShardProgress(shard=3, state="running", pid=12, batches_total=9, batches_done=4, eta_s=None)
    p.progress_at, p.stalled_process, p.stalled_since = 100.5, "uploader", 99.0
    p.save(tmp_path)
    back = ShardProgress.read(tmp_path, 3)
    assert back == p and back.history == p.history and len(back.history) == 1
    assert ShardProgress.read(tmp_path, 4) is None  # no file: not started


@pytest.mark.parametrize(
    "content, says",
    [
        (b"\xff\xfe", "not JSON (2 bytes)"),
        (b"[1, 2]", "holds a list, not a progress record"),
        (json.dumps({"shard": 3, "colour": "red"}).encode(), "colour: unknown key"),
        (
            json.dumps({"shard": 3, "batches_done": "4"}).encode(),
            "batches_done: Input should be a valid integer, got '4'",
        ),
        (json.dumps({"shard": 3, "eta_s": True}).encode(), "eta_s: Input should be a valid number, got True"),
        (json.dumps({"shard": 5}).encode(), "shard is 5, expected 3"),
    ],
    ids=["bytes", "list", "unknown-key", "wrong-type", "bool-as-number", "other-shard"],
)
def test_a_damaged_progress_file_is_named_with_what_is_wrong(tmp_path, content, says):
    path = RunDir(tmp_path).progress_file(3)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(DamagedProgress) as caught:
        ShardProgress.read(tmp_path, 3)
    assert str(caught.value) == f"{path}: {says}"
    assert ShardProgress.load(tmp_path, 3) is None


def test_durations_read_as_minutes_and_seconds_then_hours_and_minutes():
    assert [format_duration(s) for s in (0, 65.9, 3599, 3600, 3725, 90000)] == [
        "0m00s",
        "1m05s",
        "59m59s",
        "1h00m",
        "1h02m",
        "25h00m",
    ]


def test_sizes_are_said_in_the_unit_that_fits():
    from hsextract.run.progress import format_bytes

    cases = {0: "0 B", 812: "812 B", 4_123: "4.12 kB", 4_100_000: "4.10 MB", 15_700_000: "15.7 MB"}
    cases |= {2_904_000_000: "2.90 GB", 15.7e12: "15.7 TB", 1_234.5e12: "1,234.5 TB"}
    for n, text in cases.items():
        assert format_bytes(n) == text, n
