"""The output's completion records as the one ledger of finished batches (output/records.py
``check_batches``): a batch is done only if its record is this plan's and the object is there as recorded. On
a local output (no stored CRC32) a same-size alteration shows only in the full check, which computes the CRC32
from the bytes."""

import json

from support.damage import copy_output, flip_in_states, truncate_half

from hsextract.output import Plan
from hsextract.output.records import check_batches, done_in_output, done_key
from hsextract.storage.local import LocalSink
from hsextract.validation import seal, unseal


def test_each_way_a_batch_can_be_not_done_is_named_and_only_sound_ones_count(written_output, tmp_path):
    out = copy_output(written_output, tmp_path / "out")
    plan = Plan.from_json(json.loads((out / "hsextract" / "plan.json").read_text()))
    sink = LocalSink(out)
    keys = [b.key for b in plan.batches]
    assert done_in_output(sink) == set(keys)
    assert check_batches(sink, keys, plan.plan_hash, full=True) == (
        {},
        {k: unseal(json.loads((out / done_key(k)).read_text()), ValueError) for k in keys},
    )

    no_record, other_plan, missing, short, flipped, edited = keys[:6]
    (out / done_key(no_record)).unlink()
    record = json.loads((out / done_key(other_plan)).read_text())
    (out / done_key(other_plan)).write_text(json.dumps(seal({**record, "plan_hash": "0123abcd"})))
    edited_record = json.loads((out / done_key(edited)).read_text())
    (out / done_key(edited)).write_text(json.dumps({**edited_record, "size": edited_record["size"] + 1}))
    (out / missing).unlink()
    truncate_half(out / short)
    flip_in_states(out / flipped)
    size = (out / short).stat().st_size

    problems, records = check_batches(sink, keys, plan.plan_hash)
    assert problems == {
        no_record: "no completion record",
        other_plan: "completion record of another plan (0123abcd)",
        missing: "batch file missing",
        short: f"batch file has {size} bytes, {record_size(out, short)} were uploaded",
        edited: "its completion record is damaged (its content does not match its checksum (edited or damaged))",
    }
    assert set(records) == set(keys) - set(problems)  # the flip keeps the size: only the bytes tell
    problems, records = check_batches(sink, keys, plan.plan_hash, full=True)
    assert set(problems) == {no_record, other_plan, missing, short, flipped, edited}
    assert problems[flipped].startswith("batch file CRC32 ") and problems[flipped].endswith(" was uploaded")
    assert set(records) == set(keys[6:])


def record_size(out, key) -> int:
    return json.loads((out / done_key(key)).read_text())["size"]
