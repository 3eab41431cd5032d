"""Tests for prepare/sources.py (and its hub and S3 readers): spec parsing, every source kind, selection, names,
columns, row kinds, de-duplication, fingerprints, and the errors each bad source gives."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.s3server import S3Endpoint

from hsextract.config import RunConfig, load_yaml
from hsextract.demo import build_tokenizer, make_conversations, write_jsonl
from hsextract.errors import HsextractError
from hsextract.prepare.plan import fingerprint_changes
from hsextract.prepare.rows import JsonLine
from hsextract.prepare.source_spec import SourceSpec, parse_source
from hsextract.prepare.sources import changed_files, finish_row, resolve_sources
from hsextract.prepare.tokenize import load_samples


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def rows_of(data, **kwargs) -> list[tuple[int, int, dict]]:
    return list(resolve_sources(data, **kwargs).rows())


def load(data, tokenizer, **kwargs):
    return load_samples(data, tokenizer, max_length=4096, progress=False, **kwargs)


def numbered(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"r{i}", "input_ids": [1 + i % 50, 2, 3]} for i in range(start, start + n)]


def write_zst(rows: list[dict], path: Path, *, checksum: bool = False, frames: int = 1) -> Path:
    import zstandard

    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    step = -(-len(data) // frames)
    compress = zstandard.ZstdCompressor(write_checksum=checksum).compress
    path.write_bytes(b"".join(compress(data[i : i + step]) for i in range(0, len(data), step)))
    return path


def write_gz(rows: list[dict], path: Path) -> Path:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


# -- parsing ---------------------------------------------------------------------------------------------------------
def test_query_string_options_and_yaml_mappings_parse_to_the_same_spec():
    from_cli = parse_source("hf:org/tools?split=train&limit=500&name=tools&columns=messages:conv,id:uid")
    from_yaml = parse_source(
        {
            "path": "hf:org/tools",
            "split": "train",
            "limit": 500,
            "name": "tools",
            "columns": {"messages": "conv", "id": "uid"},
        }
    )
    assert (
        from_cli
        == from_yaml
        == SourceSpec(
            location="hf:org/tools",
            name="tools",
            split="train",
            limit=500,
            columns=(("messages", "conv"), ("id", "uid")),
        )
    )
    assert from_cli.options() == {
        "name": "tools",
        "split": "train",
        "limit": 500,
        "columns": {"messages": "conv", "id": "uid"},
    }
    # A '?' with no '=' after it is a glob wildcard, not options.
    assert parse_source("shards/part-?.jsonl").location == "shards/part-?.jsonl"
    assert parse_source("a.jsonl?fraction=0.25").fraction == 0.25


@pytest.mark.parametrize(
    "spec, message",
    [
        ("a.jsonl?limt=5", r"unknown option\(s\) limt; known: name, split"),
        ("a.jsonl?limit=0", r"limit must be a positive integer, got '0'"),
        ("a.jsonl?limit=2.5", r"limit must be a positive integer, got '2.5'"),
        ("a.jsonl?fraction=1.5", r"fraction must be in \(0, 1\], got '1.5'"),
        ("a.jsonl?limit=5&sample=3", r"give one of limit, fraction, sample, not limit and sample"),
        ("a.jsonl?columns=messages", r"columns must be FIELD:COLUMN"),
        ("a.jsonl?columns=msgs:conv", r"columns names unknown field\(s\) msgs"),
        ("a.jsonl?name=a/b", r"name 'a/b' must be letters, digits"),
        ({"limit": 5}, r"has no 'path'"),
        ("x?limit=99999999999999999999", r"limit=99999999999999999999 is larger than any source can hold"),
        ("x?sample=99999999999999999999", r"sample=99999999999999999999 is larger than any source can hold"),
        ("?limit=3", r"has options but no path: write PATH\?limit=3"),
        ("s3://AKIAKEY:SECRETVALUE@bkt/data.jsonl", r"carries credentials in its URL"),
        ("s3://AKIAKEY:SECRETVALUE@bkt/data.jsonl?limit=2", r"carries credentials in its URL"),
        ({"path": "s3://SECRETVALUE@bkt/data.jsonl"}, r"carries credentials in its URL"),
    ],
)
def test_bad_options_are_refused_naming_the_source(spec, message):
    with pytest.raises(HsextractError, match=message) as e:
        parse_source(spec)
    assert "SECRETVALUE" not in str(e.value) and "AKIAKEY" not in str(e.value)


def test_config_takes_one_string_a_list_and_a_yaml_list_of_strings_and_mappings(tmp_path):
    base = {"model": "m", "output": "o", "run_dir": "r"}
    assert RunConfig(data="a.jsonl", **base).data == "a.jsonl"
    assert RunConfig(data=("a.jsonl", "b.jsonl?limit=3"), **base).data == ("a.jsonl", "b.jsonl?limit=3")
    (tmp_path / "job.yaml").write_text(
        "data:\n  - convs/*.jsonl\n  - path: hf:org/tools\n    limit: 50\n    name: tools\n"
    )
    cfg = RunConfig(**load_yaml(tmp_path / "job.yaml"), **base)
    assert cfg.data == ("convs/*.jsonl", {"path": "hf:org/tools", "limit": 50, "name": "tools"})
    assert RunConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    with pytest.raises(HsextractError, match=r"unknown option\(s\) limt"):
        RunConfig(data=("a.jsonl?limt=1",), **base)


# -- each kind of source ---------------------------------------------------------------------------------------------
def test_rows_read_unparsed_and_finished_elsewhere_equal_the_parsed_rows(tmp_path):
    rows = [{"id": f"r{i}", "dialog": [{"from": "human", "value": f"q{i}"}]} for i in range(6)]
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines[2] = '{"id": "cut'
    path.write_text("\n".join(lines[:4]) + "\n\n" + "\n".join(lines[4:]) + "\n")
    mix = resolve_sources([f"{path}?columns=conversations:dialog&sample=4"], seed=3)
    columns = tuple(s.spec.columns for s in mix.sources)

    raw = list(mix.rows(parse=False))
    assert all(isinstance(row, JsonLine) for _, _, row in raw)  # bytes, as read
    assert [(i, p, finish_row(row, columns[i])) for i, p, row in raw] == list(mix.rows())
    # Which 4 rows the sample keeps depends on the path (tmp_path): the bad line is named from every row.
    whole = resolve_sources([f"{path}?columns=conversations:dialog"], seed=3)
    everything = [finish_row(row, columns[0]) for _, _, row in whole.rows(parse=False)]
    assert everything == [row for _, _, row in whole.rows()]
    assert "line 3 is not valid JSON" in str(everything)


def test_compressed_jsonl_globs_and_directories_read_their_rows_in_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(numbered(3), shards / "part-0.jsonl")
    write_gz(numbered(2, 3), shards / "part-1.jsonl.gz")
    write_zst(numbered(2, 5), shards / "part-2.jsonl.zst")
    (shards / "notes.txt").write_text("not data")

    by_glob = rows_of(str(shards / "part-*"))
    by_dir = rows_of(str(shards))

    assert [row["id"] for _, _, row in by_glob] == [f"r{i}" for i in range(7)]
    assert [(s, p) for s, p, _ in by_glob] == [(0, i) for i in range(7)]
    assert by_dir == by_glob
    zst_only = resolve_sources(str(shards / "part-2.jsonl.zst"))
    assert [row["id"] for _, _, row in zst_only.rows()] == ["r5", "r6"]


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("keep", [0.9, 1 / 3])
def test_a_zst_file_cut_short_is_refused_naming_the_truncation(tmp_path, tokenizer, checksum, keep):
    rows = [{"id": f"r{i}", "text": f"row {i} " * (5 + i % 40)} for i in range(200)]
    whole = write_zst(rows, tmp_path / "whole.jsonl.zst", checksum=checksum, frames=3)
    assert [r["id"] for _, _, r in rows_of(str(whole))] == [r["id"] for r in rows]
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(whole.read_bytes()[: int(whole.stat().st_size * keep)])
    with pytest.raises(HsextractError, match=rf"cannot read {cut}: .*cut short"):
        rows_of(str(cut))
    with pytest.raises(
        HsextractError, match="cut short"
    ):  # the preparation a run does, not "no usable samples"
        load(str(cut), tokenizer)


def test_each_source_files_hash_is_recorded_and_a_changed_file_is_named(tmp_path):
    import hashlib
    import os

    (tmp_path / "shards").mkdir()
    a = write_zst(numbered(40), tmp_path / "shards" / "a.jsonl.zst", checksum=False)
    b = write_jsonl(numbered(5, 40), tmp_path / "shards" / "b.jsonl")
    before = resolve_sources(str(tmp_path / "shards")).describe()
    files = before[0]["identity"]["files"]
    for entry, path in zip(files, (a, b), strict=True):
        want = hashlib.blake2b(digest_size=32)
        want.update(str(path.stat().st_size).encode() + b"\0" + path.read_bytes())
        assert entry["path"] == str(path) and entry["hash"] == want.hexdigest()
    # One byte of the compressed file changed, same size and time: no frame checksum can show it, the hash does.
    stat = a.stat()
    raw = bytearray(a.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    a.write_bytes(raw)
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    now = resolve_sources(str(tmp_path / "shards")).describe()
    [line] = changed_files(before, now)
    assert line.startswith(f"data file {a} changed (content hash {files[0]['hash']} -> ")
    b.unlink()
    assert changed_files(before, resolve_sources(str(a)).describe())[-1] == f"data file {b} is gone"
    older = copy.deepcopy(now)  # a data report written before file hashes were recorded
    for entry in older[0]["identity"]["files"]:
        del entry["hash"]
    assert changed_files(older, now) == []


def write_hub_folder(root: Path, rows: list[dict]) -> Path:
    """A dataset repository as the Hub lays it out: two Parquet shards under data/ and a README with configs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "data").mkdir(parents=True)
    half = len(rows) // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(part), root / "data" / f"train-0000{i}-of-00002.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*.parquet\n"
        "---\n# A dataset\n"
    )
    return root


def test_hub_layout_folder_and_saved_dataset_are_read_through_datasets(tmp_path):
    import datasets

    rows = numbered(6)
    hub = write_hub_folder(tmp_path / "hub", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))

    mix = resolve_sources([str(hub), str(tmp_path / "saved") + "?limit=4"], cache_dir=tmp_path / "cache")

    assert [s.kind for s in mix.sources] == ["hub_folder", "saved_dataset"]
    got = [(s, p, r["id"]) for s, p, r in mix.rows()]
    assert got == [(0, i, f"r{i}") for i in range(6)] + [(1, i, f"r{i}") for i in range(4)]
    assert any((tmp_path / "cache" / "datasets").iterdir())  # load_dataset's Arrow cache is in the run dir
    with pytest.raises(HsextractError, match=r'Unknown split "test". Should be one of \[.train.\]'):
        resolve_sources(f"{hub}?split=test", cache_dir=tmp_path / "cache")


def test_a_hub_layout_folder_edited_in_place_is_read_anew(tmp_path):
    hub = write_hub_folder(tmp_path / "hub", numbered(4))
    first = resolve_sources(str(hub), cache_dir=tmp_path / "cache")
    shutil.rmtree(hub)
    write_hub_folder(hub, numbered(6, 10))  # the same file names, other rows

    again = resolve_sources(str(hub), cache_dir=tmp_path / "cache")

    assert [r["id"] for _, _, r in again.rows()] == [f"r{i}" for i in range(10, 16)]
    assert again.fingerprint() != first.fingerprint()


def test_unknown_hub_id_offline_says_so_and_how_to_fill_the_cache(monkeypatch):
    import datasets

    monkeypatch.setattr(
        datasets.config, "HF_HUB_OFFLINE", True
    )  # as HF_HUB_OFFLINE=1 sets it (conftest does)
    with pytest.raises(HsextractError) as error:
        resolve_sources("hf:no-such-org/no-such-dataset?split=train")
    message = str(error.value)
    assert "data source hf:no-such-org/no-such-dataset" in message
    assert "offline" in message and "datasets.load_dataset('no-such-org/no-such-dataset')" in message


def test_hub_id_without_network_or_offline_flag_says_the_hub_is_unreachable_at_once(
    monkeypatch, tiny_model, tmp_path
):
    """`hsextract run --data hf:...` where the Hub cannot be reached and HF_HUB_OFFLINE is not set: one line in
    seconds naming the endpoint and HF_HUB_OFFLINE=1 (datasets alone retried ~25 s, then blamed the id)."""
    import socket
    import time

    import datasets
    from click.testing import CliRunner
    from support.cli import cli_run_args

    from hsextract.cli import main

    with socket.socket() as closed:  # a loopback port nothing listens on: refused at once, as with no route
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    for flag in (
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
    ):  # as without HF_HUB_OFFLINE (support/cli.py sets it)
        monkeypatch.setattr(datasets.config, flag, False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    args = cli_run_args(tmp_path, tiny_model, "hf:no-such-org/no-such-dataset?split=train", no_progress=True)
    start = time.monotonic()
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 2 and time.monotonic() - start < 10, result.output
    err = result.stderr
    assert (
        f"data source hf:no-such-org/no-such-dataset: the Hugging Face Hub ({endpoint}) cannot be reached"
        in err
    )
    assert (
        "Connection refused" in err and "set HF_HUB_OFFLINE=1 to read the dataset from the local cache" in err
    )
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


@pytest.mark.usefixtures("aws_test_env")
def test_s3_prefix_is_fetched_once_into_the_cache_with_its_etags(tmp_path, s3: S3Endpoint, s3_bucket: str):
    client = s3.client()
    for i, rows in enumerate((numbered(2), numbered(3, 2))):
        body = "".join(json.dumps(r) + "\n" for r in rows).encode()
        client.put_object(Bucket=s3_bucket, Key=f"convs/part-{i}.jsonl", Body=body)
    client.put_object(Bucket=s3_bucket, Key="convs/README.txt", Body=b"not data")
    cache = tmp_path / "cache"

    mix = resolve_sources(f"s3://{s3_bucket}/convs", cache_dir=cache, s3_endpoint_url=s3.url)

    assert [r["id"] for _, _, r in mix.rows()] == [f"r{i}" for i in range(5)]
    objects = mix.sources[0].identity["objects"]
    assert [o["key"] for o in objects] == ["convs/part-0.jsonl", "convs/part-1.jsonl"]
    assert all(o["etag"] and o["size"] > 0 for o in objects)
    fetched = cache / "s3" / s3_bucket / "convs" / "part-0.jsonl"
    stamp = fetched.stat().st_mtime_ns
    again = resolve_sources(f"s3://{s3_bucket}/convs/", cache_dir=cache, s3_endpoint_url=s3.url)
    assert fetched.stat().st_mtime_ns == stamp  # not fetched again
    assert again.fingerprint() == mix.fingerprint()

    client.put_object(Bucket=s3_bucket, Key="convs/part-1.jsonl", Body=b'{"input_ids": [7]}\n')
    changed = resolve_sources(f"s3://{s3_bucket}/convs", cache_dir=cache, s3_endpoint_url=s3.url)
    assert changed.fingerprint() != mix.fingerprint()
    assert [r.get("id") for _, _, r in changed.rows()] == ["r0", "r1", None]

    with pytest.raises(HsextractError, match=rf"data source s3://{s3_bucket}/nothing: no data file at"):
        resolve_sources(f"s3://{s3_bucket}/nothing", cache_dir=cache, s3_endpoint_url=s3.url)
    with pytest.raises(
        HsextractError, match=r"data source s3://no-such-bucket-x/convs: bucket 'no-such-bucket-x'"
    ):
        resolve_sources("s3://no-such-bucket-x/convs", cache_dir=cache, s3_endpoint_url=s3.url)


# -- selection, names, columns ---------------------------------------------------------------------------------------
def test_limit_fraction_and_sample_select_rows_reproducibly_by_seed(tmp_path):
    path = str(write_jsonl(numbered(40), tmp_path / "rows.jsonl"))

    limited = [p for _, p, _ in rows_of(f"{path}?limit=5")]
    fraction = [p for _, p, _ in rows_of(f"{path}?fraction=0.25", seed=1)]
    sample = [p for _, p, _ in rows_of(f"{path}?sample=7", seed=1)]

    assert limited == [0, 1, 2, 3, 4]
    assert len(fraction) == 10 and fraction == sorted(fraction) and len(set(fraction)) == 10
    assert fraction == [p for _, p, _ in rows_of(f"{path}?fraction=0.25", seed=1)]
    assert fraction != [p for _, p, _ in rows_of(f"{path}?fraction=0.25", seed=2)]
    assert len(sample) == 7 and set(sample) <= set(range(40))
    with pytest.raises(HsextractError, match=r"sample=41 asks for more rows than its 40"):
        rows_of(f"{path}?sample=41")


def test_ids_carry_source_names_and_stay_unique_across_sources(tmp_path, tokenizer):
    a = write_jsonl(numbered(3), tmp_path / "a.jsonl")
    b = write_jsonl([{"input_ids": [5, 6]}, {"input_ids": [7]}], tmp_path / "chat.jsonl")

    samples, report = load([str(a), str(b), f"{a}?name=again&limit=1"], tokenizer)

    assert samples.sample_ids == ["a/r0", "a/r1", "a/r2", "chat/0", "chat/1", "again/r0"]
    assert [(s["name"], s["rows"], s["kept"]) for s in report.sources] == [
        ("a", 3, 3),
        ("chat", 2, 2),
        ("again", 1, 1),
    ]
    alone, _ = load(str(a), tokenizer)
    assert alone.sample_ids == ["r0", "r1", "r2"]  # one unnamed source keeps its ids as they are
    with pytest.raises(HsextractError, match=r"two data sources share a name \(x, x\)"):
        resolve_sources([f"{a}?name=x", f"{b}?name=x"])


def test_columns_map_fields_and_a_missing_column_is_named(tmp_path, tokenizer):
    chat = make_conversations(2, seed=4)
    renamed = [{"uid": f"u{i}", "dialog": row["messages"]} for i, row in enumerate(chat)]
    path = write_jsonl(renamed, tmp_path / "renamed.jsonl")
    reference = write_jsonl(
        [{"id": f"u{i}", "messages": r["messages"]} for i, r in enumerate(chat)], tmp_path / "ref.jsonl"
    )

    mapped, _ = load(f"{path}?columns=messages:dialog,id:uid", tokenizer)
    expected, _ = load(str(reference), tokenizer)

    assert mapped.sample_ids == expected.sample_ids == ["u0", "u1"]
    np.testing.assert_array_equal(mapped.input_ids, expected.input_ids)
    np.testing.assert_array_equal(mapped.loss_mask, expected.loss_mask)
    with pytest.raises(
        HsextractError, match=r"column 'conversation' \(given for messages\) is not in its rows"
    ):
        resolve_sources(f"{path}?columns=messages:conversation")


# -- row kinds -------------------------------------------------------------------------------------------------------
def test_text_rows_supervise_every_token_unless_a_mask_is_given(tmp_path, tokenizer):
    text = "def return import class for while if else print"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    mask = [0] * 3 + [1] * (len(ids) - 3)
    path = write_jsonl(
        [{"text": text}, {"text": text, "loss_mask": mask}, {"text": ""}], tmp_path / "t.jsonl"
    )

    samples, report = load(str(path), tokenizer)

    assert (report.kept, report.skipped_empty) == (2, 1)
    for k, want in enumerate(([1] * len(ids), mask)):
        got_ids, got_mask = samples.sample(k)
        assert got_ids.tolist() == ids and got_mask.tolist() == want


def test_openai_content_parts_and_tool_turns_render_like_plain_strings(tmp_path, tokenizer):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}
    plain = [
        {"role": "user", "content": "weather in paris"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "it is sunny", "reasoning_content": "the tool said so"},
    ]
    parts = [dict(m) for m in plain]
    parts[0]["content"] = [{"type": "text", "text": "weather "}, {"type": "text", "text": "in paris"}]
    parts[2]["content"] = [{"type": "text", "text": "sunny"}]
    image = [dict(parts[0], content=[{"type": "image_url", "image_url": {"url": "x"}}]), plain[3]]
    path = write_jsonl([{"messages": plain}, {"messages": parts}, {"messages": image}], tmp_path / "p.jsonl")

    samples, report = load(str(path), tokenizer)

    assert report.kept == 2 and report.skipped_malformed == 1
    assert "content part of type 'image_url'" in report.examples[0]["reason"]
    (a_ids, a_mask), (b_ids, b_mask) = samples.sample(0), samples.sample(1)
    assert a_ids.tolist() == b_ids.tolist() and a_mask.tolist() == b_mask.tolist()
    # The arguments string is parsed into its object before rendering, as vLLM does.
    served = [{**m, "content": m["content"] or ""} for m in plain]
    served[1]["tool_calls"] = [{**call, "function": {**call["function"], "arguments": {"city": "paris"}}}]
    expected = tokenizer.apply_chat_template(served, tokenize=False)
    assert tokenizer.decode(a_ids.tolist()) == expected


# -- de-duplication and identity -------------------------------------------------------------------------------------
def test_dedupe_keeps_the_first_of_identical_rows_across_sources(tmp_path, tokenizer):
    a = write_jsonl(numbered(4), tmp_path / "a.jsonl")
    b = write_jsonl([*numbered(2, 2), {"id": "new", "input_ids": [9, 9]}], tmp_path / "b.jsonl")

    samples, report = load([str(a), str(b)], tokenizer, dedupe=True)
    everything, _ = load([str(a), str(b)], tokenizer)

    assert samples.sample_ids == ["a/r0", "a/r1", "a/r2", "a/r3", "b/new"]
    assert [s["skipped_duplicate"] for s in report.sources] == [0, 2]
    assert report.skipped_duplicate == 2 and "2 duplicates dropped" in report.summary()
    assert len(everything) == 7


def test_fingerprint_names_the_changed_option_of_the_changed_source(tmp_path):
    a = write_jsonl(numbered(4), tmp_path / "a.jsonl")
    b = write_jsonl(numbered(4, 4), tmp_path / "b.jsonl")
    old = resolve_sources([str(a), f"{b}?limit=3&name=bee"]).fingerprint()
    new = resolve_sources([str(a), f"{b}?limit=2&name=bee"]).fingerprint()

    assert fingerprint_changes(old, new) == ["sources.bee.limit: 3 -> 2"]
    b.touch()
    shutil.copy(a, tmp_path / "copy.jsonl")
    same = resolve_sources([str(tmp_path / "copy.jsonl") + "?name=a", f"{b}?limit=3&name=bee"]).fingerprint()
    assert same == old  # content decides, not paths or mtimes
    write_jsonl(numbered(5), a)
    edited = resolve_sources([str(a), f"{b}?limit=3&name=bee"]).fingerprint()
    [line] = fingerprint_changes(old, edited)
    assert line.startswith("sources.a.identity: ")
    # One plain source keeps the content hash older plans recorded.
    from hsextract.prepare.rows import data_fingerprint

    assert resolve_sources(str(b)).fingerprint() == {"data": data_fingerprint(b)}


# -- errors ----------------------------------------------------------------------------------------------------------
def test_each_bad_source_is_an_error_naming_it(tmp_path, tokenizer):
    good = str(write_jsonl(numbered(2), tmp_path / "good.jsonl"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(numbered(1), mixed / "a.jsonl")
    write_jsonl([{"text": "plain"}], mixed / "b.jsonl")
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"input_ids": [1]}\n' * 1000)[:60])
    useless = write_jsonl([{"body": "x"}], tmp_path / "useless.jsonl")

    cases = [
        (str(tmp_path / "missing.jsonl"), r"'missing' \(.*missing\.jsonl\) does not exist"),
        (str(tmp_path / "none-*.jsonl"), r"the glob matches no data file"),
        (str(mixed), r"mixes row kinds across its files \(input_ids in a\.jsonl; text in b\.jsonl\)"),
        (str(cut), r"cut\.jsonl\.gz: .*damaged or cut short"),
        (f"{good}?split=train", r"split, config and revision apply to hf: ids and dataset directories only"),
    ]
    for bad, message in cases:
        with pytest.raises(HsextractError, match=message):
            load([good, bad], tokenizer)
    with pytest.raises(
        HsextractError, match=r"no usable samples in 'useless' \(.*useless\.jsonl\): 1 rows: 0 kept"
    ):
        load([good, str(useless)], tokenizer)


def test_a_data_files_hash_is_kept_in_the_cache_under_its_stamp_and_found_again_only_for_the_same_file(
    tmp_path,
):
    """A relaunch reads no data to hash it (the memo answers); a file rewritten with its size and mtime set back,
    or a damaged memo, is hashed again from its bytes. The reference is the hash without a memo."""
    import hashlib
    import os

    from hsextract.prepare.rows import tree_fingerprint

    data, memo = tmp_path / "rows.jsonl", tmp_path / "cache"
    data.write_text('{"text": "one"}\n')
    first = tree_fingerprint(data, memo)
    assert first == tree_fingerprint(data)
    (kept,) = memo.glob("data-*.json")
    stand_in = hashlib.blake2b(b"stand-in", digest_size=32).hexdigest()
    kept.write_text(json.dumps({"blake2b": stand_in}))
    assert tree_fingerprint(data, memo) == stand_in  # answered from the memo: the file was not read

    st = data.stat()
    data.write_text('{"text": "two"}\n')  # same size
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    rewritten = tree_fingerprint(data, memo)
    assert rewritten == tree_fingerprint(data) != first
    (fresh,) = set(memo.glob("data-*.json")) - {kept}
    fresh.write_text("{not json")
    assert tree_fingerprint(data, memo) == rewritten
