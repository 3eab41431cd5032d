"""The output directory of regenerate: chunks written whole, what is done, settings compared on rerun, and
``run``'s reader taking the directory as it is (regenerate/ledger.py, prepare/sources.py)."""

import json

import pytest

from hsextract.errors import HsextractError
from hsextract.prepare import rows as rowio
from hsextract.prepare.sources import resolve_sources
from hsextract.regenerate.ledger import Ledger, chunk_key, compress, decompress, record_key
from hsextract.storage.fileio import TMP_MARK
from hsextract.validation import seal

SETTINGS = {"served_model": "m", "request": {"temperature": 0.6}, "turns": "all", "data": {"data": "h1"}}


def _row(i):
    return {
        "id": f"r{i}",
        "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}],
    }


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_chunks_are_read_back_by_runs_reader_and_listed_as_done(tmp_path, compression):
    ledger = Ledger(str(tmp_path))
    ledger.check_settings(SETTINGS, [], restart=False)
    ledger.write_settings(SETTINGS, [{"name": "d", "source": "d.jsonl"}], {"model": "m"})
    ledger.write_chunk(0, [_row(0), _row(1)], [], compression)
    ledger.write_chunk(1, [_row(2)], ["r3"], compression)
    done = ledger.done()
    assert done.written == {"r0", "r1", "r2"} and done.dropped == {"r3"} and done.next_index == 2
    assert "r3" in done and "r4" not in done
    files = sorted(tmp_path.glob("chunk-*.jsonl.*"))
    assert [f.name for f in files] == [chunk_key(0, compression), chunk_key(1, compression)]
    assert [r["id"] for f in files for r in rowio.read_rows(f)] == ["r0", "r1", "r2"]
    # run's --data takes the directory: its chunks only (not the records, though they end in .json), and the
    # settings in the source's identity for the data report.
    mix = resolve_sources(str(tmp_path))
    assert [p.name for p in mix.sources[0].files] == [f.name for f in files]
    regenerated = mix.describe()[0]["identity"]["regenerated"]
    assert regenerated["settings"] == SETTINGS and regenerated["inputs"] == [
        {"name": "d", "source": "d.jsonl"}
    ]


def test_what_a_crash_leaves_is_never_counted_done(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.write_chunk(0, [_row(0)], [], "zstd")
    ledger.write_chunk(1, [_row(1)], [], "zstd")
    # Killed after the record and before the chunk; and killed in the middle of writing a chunk.
    (tmp_path / chunk_key(1, "zstd")).unlink()
    (tmp_path / f"{chunk_key(2, 'zstd')}{TMP_MARK}123-4").write_bytes(b"half a chunk")
    done = ledger.done()
    assert done.written == {"r0"} and done.next_index == 2
    assert not list(tmp_path.glob(f"*{TMP_MARK}*"))  # the partial write is gone
    assert not (tmp_path / record_key(1)).exists() and "its chunk is missing" in done.notes[0]
    ledger.write_chunk(2, [_row(5)], [], "zstd")
    assert ledger.done().written == {"r0", "r5"}


def _edit_record(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_record_that_does_not_prove_its_chunk_is_written_again_from_the_chunk(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.write_chunk(0, [_row(0), _row(1)], [], "gzip")
    ledger.write_chunk(1, [_row(2), _row(3)], [], "gzip")
    ledger.write_chunk(2, [_row(4)], [], "gzip")
    # Chunk 1 lost and chunk 0's record edited to claim its rows; chunk 2's record edited to omit a row, and
    # another resealed with a wrong size.
    (tmp_path / chunk_key(1, "gzip")).unlink()
    _edit_record(tmp_path / record_key(0), written=["r0", "r1", "r2", "r3"])
    (tmp_path / record_key(2)).write_text(
        json.dumps(seal({**json.loads((tmp_path / record_key(2)).read_text()), "size": 9}))
    )
    done = ledger.done()
    assert done.written == {"r0", "r1", "r4"} and done.chunks == 2  # r2, r3 requested again, r4 not twice
    assert "does not prove itself" in done.notes[0] and "written again from its 2 rows" in done.notes[0]
    assert "are not the 9 bytes its record names" in done.notes[2]
    again = ledger.done()  # the records written again prove their chunks
    assert again.written == done.written and again.notes == []
    (tmp_path / record_key(0)).unlink()
    assert ledger.done().notes == [
        f"{chunk_key(0, 'gzip')}: it has no record; the chunk is sound on its own: its record is written again from its 2 rows"
    ]


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_damaged_chunk_is_set_aside_and_its_rows_requested_again(tmp_path, compression, damage):
    ledger = Ledger(str(tmp_path))
    ledger.write_settings(SETTINGS, [], {"model": "m"})
    ledger.write_chunk(0, [_row(i) for i in range(20)], [], compression)
    ledger.write_chunk(1, [_row(20)], ["r21"], compression)
    path = tmp_path / chunk_key(0, compression)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    done = ledger.done()
    assert done.written == {"r20"} and done.dropped == {"r21"} and done.next_index == 2
    assert f"{path.name}: its " in done.notes[0] and f"set aside as {path.name}.rejected" in done.notes[0]
    assert not path.exists() and (tmp_path / f"{path.name}.rejected").read_bytes() == bytes(data)
    # run reads the sound chunk only: not the one set aside, not the records.
    assert [r["id"] for _, _, r in resolve_sources(str(tmp_path)).rows()] == ["r20"]


def test_bookkeeping_files_are_never_read_as_rows_even_without_regenerate_json(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.write_chunk(0, [_row(0)], [], "zstd")
    (tmp_path / "chunk-000000.rows.json").write_text(json.dumps({"written": ["r0"], "dropped": []}))  # older
    (tmp_path / "chunk-000001.jsonl.zst.rejected").write_bytes(b"x")
    mix = resolve_sources(str(tmp_path))
    assert [p.name for p in mix.sources[0].files] == [chunk_key(0, "zstd")]
    assert [r["id"] for _, _, r in mix.rows()] == ["r0"]


@pytest.mark.parametrize(
    "edit, problem",
    [
        ({"settings": "x"}, "settings: not an object"),
        ({"sources": "d.jsonl"}, "sources: not a list"),
        ({"settings": {**SETTINGS, "request": [1]}}, "settings.request: not an object"),
        ({"format": 3}, "format 3 is none of"),
        ({"served": None, "reseal": False}, "does not match its checksum"),
        ({"served": None}, "served: not an object"),
    ],
)
def test_a_damaged_settings_record_is_one_message_for_regenerate_and_run(tmp_path, edit, problem):
    ledger = Ledger(str(tmp_path))
    ledger.write_settings(SETTINGS, [{"name": "d", "source": "d.jsonl"}], {"model": "m"})
    ledger.write_chunk(0, [_row(0)], [], "zstd")
    path = tmp_path / "regenerate.json"
    reseal = edit.pop("reseal", True)
    record = {**json.loads(path.read_text()), **edit}
    path.write_text(json.dumps(seal(record) if reseal else record))
    for read in (
        lambda: ledger.check_settings(SETTINGS, [], restart=False),
        lambda: resolve_sources(str(tmp_path)),
    ):
        with pytest.raises(HsextractError) as e:
            read()
        assert "regenerate.json is damaged" in str(e.value) and problem in str(e.value), str(e.value)
        assert "--restart" in str(e.value)


def test_an_older_output_is_resumed_its_chunks_proving_themselves(tmp_path):
    """Format /1: no seal, a row list beside each chunk and no record."""
    ledger = Ledger(str(tmp_path))
    ledger.write_chunk(0, [_row(0), _row(1)], [], "zstd")
    (tmp_path / record_key(0)).unlink()
    (tmp_path / "chunk-000000.rows.json").write_text(
        json.dumps({"written": ["r0", "r1", "r9"], "dropped": []})
    )
    old = {"format": "hsextract-regenerate/1", "settings": SETTINGS, "served": {}, "sources": []}
    (tmp_path / "regenerate.json").write_text(json.dumps(old))
    assert ledger.check_settings(SETTINGS, [], restart=False)["settings"] == SETTINGS
    assert json.loads((tmp_path / "regenerate.json").read_text())["format"] == "hsextract-regenerate/2"
    done = ledger.done()
    assert done.written == {"r0", "r1"} and "no record" in done.notes[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        chunk_key(0, "zstd"),
        record_key(0),
        "regenerate.json",
    ]


def test_other_settings_are_refused_by_name_and_restart_starts_over(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.write_settings(SETTINGS, [], {"model": "m"})
    ledger.write_chunk(0, [_row(0)], [], "zstd")
    assert ledger.check_settings(SETTINGS, [], restart=False)["settings"] == SETTINGS
    other = {**SETTINGS, "request": {"temperature": 0.7, "top_k": 20}, "turns": "first"}
    with pytest.raises(HsextractError) as e:
        ledger.check_settings(other, [], restart=False)
    message = str(e.value)
    assert "--temperature 0.6 -> 0.7" in message and "--top-k (not given) -> 20" in message
    assert '--turns "all" -> "first"' in message and "--restart" in message and "the data" not in message
    with pytest.raises(HsextractError, match="the data"):
        ledger.check_settings({**SETTINGS, "data": {"data": "h2"}}, [], restart=False)
    assert ledger.check_settings(other, [], restart=True) is None
    assert ledger.done().written == set() and not list(tmp_path.iterdir())


def test_chunks_without_a_record_are_not_taken_for_a_resumable_output(tmp_path):
    Ledger(str(tmp_path)).write_chunk(0, [_row(0)], [], "zstd")
    with pytest.raises(HsextractError, match="no regenerate.json"):
        Ledger(str(tmp_path)).check_settings(SETTINGS, [], restart=False)
    (tmp_path / "regenerate.json").write_text("{broken")
    with pytest.raises(HsextractError, match="damaged"):
        Ledger(str(tmp_path)).check_settings(SETTINGS, [], restart=False)


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_compression_round_trip_and_a_changed_byte_is_caught(compression):
    data = b"".join(json.dumps(_row(i)).encode() + b"\n" for i in range(50))
    packed = compress(data, compression)
    key = chunk_key(0, compression)
    assert decompress(packed, key) == data
    damaged = bytearray(packed)
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(Exception):  # noqa: B017 -- zstd's and gzip's own errors: either refuses the bytes
        decompress(bytes(damaged), key)
