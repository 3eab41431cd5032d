"""The output directory of regenerate: chunks written whole, what is done, settings compared on rerun, and
``run``'s reader taking the directory as it is (regenerate/ledger.py, prepare/sources.py)."""

import json

import pytest

from hsextract.errors import HsextractError
from hsextract.prepare import rows as rowio
from hsextract.prepare.sources import resolve_sources
from hsextract.regenerate.ledger import Ledger, chunk_key, compress, decompress, rows_key
from hsextract.storage.fileio import TMP_MARK

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
    # Killed after the row list and before the chunk; and killed in the middle of writing a chunk.
    (tmp_path / rows_key(1)).write_text(json.dumps({"written": ["r1"], "dropped": []}))
    (tmp_path / f"{chunk_key(2, 'zstd')}{TMP_MARK}123-4").write_bytes(b"half a chunk")
    done = ledger.done()
    assert done.written == {"r0"} and done.next_index == 1
    assert not list(tmp_path.glob(f"*{TMP_MARK}*"))  # the partial write is gone
    # The next chunk takes index 1: its row list replaces the stale one.
    ledger.write_chunk(1, [_row(5)], [], "zstd")
    assert ledger.done().written == {"r0", "r5"}


def test_a_chunk_without_its_row_list_is_read_itself(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.write_chunk(0, [_row(0), _row(1)], [], "gzip")
    (tmp_path / rows_key(0)).unlink()
    assert ledger.done().written == {"r0", "r1"}


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
