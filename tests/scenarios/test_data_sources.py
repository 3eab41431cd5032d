"""``hsextract run`` over a mix of four sources of different kinds, in real processes: a local dataset folder in Hub
layout (two Parquet shards and a README with configs, read by ``datasets.load_dataset`` offline), a glob of JSONL
shards one of them gzipped, an S3 prefix on the loopback server, and a ``save_to_disk`` directory; with a limit, a
fraction, names and ``--dedupe``.

Checked against an independent reference: each stored sample's ids and loss mask equal those of its row given alone
as one JSONL file. Then a changed limit is refused on resume, naming the source and the option.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from support.cli import E2E_LAYERS, TINY_LIMITS, cli_run_args, status_json
from support.s3server import S3Endpoint, cli_env

from hsextract.demo import make_conversations, write_jsonl
from hsextract.output import open_output
from hsextract.prepare.tokenize import load_samples

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("aws_test_env")]

PLANTED = ("dup-0", "dup-1")


def as_sharegpt(row: dict) -> dict:
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    return {
        "id": row["id"],
        "conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in row["messages"]],
    }


def make_sources(root: Path, s3: S3Endpoint, bucket: str, vocab: int) -> tuple[list[str], dict[str, dict]]:
    """The four sources and, per ``name/id``, the row as the user wrote it."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: dict[str, dict] = {}
    # 1. Hub layout: chat rows without tools (Parquet gives them one schema), 7 + 7 rows, the first 10 taken.
    hub_rows = [
        {**r, "id": f"hub-{i}"}
        for i, r in enumerate(r for r in make_conversations(40, seed=21) if "tools" not in r)
    ][:14]
    hub = root / "hub"
    (hub / "data").mkdir(parents=True)
    for k, part in enumerate((hub_rows[:7], hub_rows[7:])):
        pq.write_table(pa.Table.from_pylist(part), hub / "data" / f"train-0000{k}-of-00002.parquet")
    (hub / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*.parquet\n"
        "---\n"
    )
    rows.update({f"hub/{r['id']}": r for r in hub_rows[:10]})
    # 2. A glob of two JSONL shards, one gzipped: chat rows with tools, tool turns and reasoning_content; half taken.
    convs = make_conversations(16, seed=22)
    for i, r in enumerate(convs):
        r["id"] = f"conv-{i}"
        if i % 3 == 0:
            r["messages"][-1]["reasoning_content"] = "first think, then answer"
    (root / "convs").mkdir()
    write_jsonl(convs[:8], root / "convs" / "part-0.jsonl")
    with gzip.open(root / "convs" / "part-1.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in convs[8:])
    rows.update({f"convs/{r['id']}": r for r in convs})
    # 3. S3: plain text rows and pre-tokenized rows, without ids (their position is the id); the first 8 taken.
    rng = random.Random(23)
    code = [{"text": f"def f{i}(x):\n    return x * {i} + {rng.randint(0, 99)}\n"} for i in range(6)]
    code += [{"input_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in (5, 17, 40, 3)]
    body = "".join(json.dumps(r) + "\n" for r in code).encode()
    s3.client().put_object(Bucket=bucket, Key="mix/code/rows.jsonl", Body=body)
    rows.update({f"code/{i}": r for i, r in enumerate(code[:8])})
    # 4. save_to_disk: ShareGPT rows, two of them the same conversations as hub rows (planted duplicates).
    plain = [r for r in make_conversations(40, seed=24) if "tools" not in r][:5]
    saved_rows = [as_sharegpt({**r, "id": f"saved-{i}"}) for i, r in enumerate(plain)]
    saved_rows += [as_sharegpt({**hub_rows[k], "id": dup}) for k, dup in zip((2, 8), PLANTED, strict=True)]
    datasets.Dataset.from_list(saved_rows).save_to_disk(str(root / "saved"))
    rows.update({f"saved/{r['id']}": r for r in saved_rows})

    specs = [
        f"{hub}?limit=10&name=hub",
        f"{root / 'convs' / 'part-*'}?fraction=0.5&name=convs",
        f"s3://{bucket}/mix/code?limit=8&name=code",
        str(root / "saved"),
    ]
    return specs, rows


def run_args(root: Path, model, specs: list[str], s3: S3Endpoint) -> list[str]:
    args = cli_run_args(
        root,
        model,
        specs[0],
        layers=",".join(map(str, E2E_LAYERS)),
        **TINY_LIMITS,
        num_proc=1,
        dedupe=True,
        s3_endpoint_url=s3.url,
        no_progress=True,
    )
    for spec in specs[1:]:
        args += ["--data", spec]
    return args


def hsextract(args, env):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_a_mix_of_four_sources_runs_and_each_row_matches_itself_alone(
    tmp_path, tiny_model, tiny_tokenizer, s3: S3Endpoint, s3_bucket: str
):
    specs, rows = make_sources(tmp_path, s3, s3_bucket, len(tiny_tokenizer))
    env = cli_env()

    r = hsextract(run_args(tmp_path, tiny_model, specs, s3), env)

    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    by_name = {s["name"]: s for s in report["sources"]}
    assert list(by_name) == ["hub", "convs", "code", "saved"]
    assert [by_name[n]["rows"] for n in by_name] == [10, 8, 8, 7]
    assert [by_name[n]["skipped_duplicate"] for n in by_name] == [0, 0, 0, 2]
    assert by_name["code"]["identity"]["objects"][0]["etag"]
    for s in report["sources"]:
        assert (
            s["kept"]
            == s["rows"]
            - s["skipped_empty"]
            - s["skipped_malformed"]
            - s["skipped_too_long"]
            - s["skipped_duplicate"]
        )
    assert "  convs (" in r.stdout and "2 duplicates dropped" in r.stdout
    # The tokens are written once: the run dir's token file is the cache's, linked.
    [cached] = (tmp_path / "run" / "cache").glob("tokens-*.safetensors")
    assert (tmp_path / "run" / "tokens.safetensors").stat().st_ino == cached.stat().st_ino

    output = open_output(str(tmp_path / "out"))
    ids = output.sample_ids()
    assert len(ids) == len(set(ids)) == report["kept"]
    assert {i.split("/")[0] for i in ids} == {"hub", "convs", "code", "saved"}
    assert {i for i in ids if i.startswith("saved/")} == {f"saved/saved-{k}" for k in range(5)}
    assert sum(i.startswith("convs/") for i in ids) == by_name["convs"]["kept"]
    for sample_id in ids:
        alone, _ = load_samples(
            write_jsonl([rows[sample_id]], tmp_path / "alone.jsonl"),
            tiny_tokenizer,
            max_length=TINY_LIMITS["max_length"],
            progress=False,
        )
        sample = output[sample_id]
        want_ids, want_mask = alone.sample(0)
        assert sample["input_ids"].tolist() == want_ids.tolist(), sample_id
        assert sample["loss_mask"].long().tolist() == want_mask.tolist(), sample_id
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [s["name"] for s in manifest["data_report"]["sources"]] == list(by_name)
    shown = status_json(tmp_path / "run")["plan"]["data_sources"]
    assert [(s["name"], s["kept"]) for s in shown] == [(n, by_name[n]["kept"]) for n in by_name]

    plan_before = (tmp_path / "run" / "plan.json").read_bytes()
    changed = [specs[0].replace("limit=10", "limit=9"), *specs[1:]]
    r = hsextract(run_args(tmp_path, tiny_model, changed, s3), env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "holds a different plan" in r.stderr and "sources.hub.limit: 10 -> 9" in r.stderr
    assert (tmp_path / "run" / "plan.json").read_bytes() == plan_before


@pytest.mark.parametrize("bad", ["column", "s3 key"])
def test_a_bad_source_in_a_mix_fails_naming_it_before_any_work(
    tmp_path, tiny_model, s3: S3Endpoint, s3_bucket: str, bad
):
    good = write_jsonl(make_conversations(3, seed=25), tmp_path / "good.jsonl")
    if bad == "column":
        source, needle = f"{good}?name=renamed&columns=messages:dialog", "data source 'renamed' ("
        needle2 = "column 'dialog' (given for messages) is not in its rows"
    else:
        source, needle = (
            f"s3://{s3_bucket}/missing/prefix",
            f"data source 'prefix' (s3://{s3_bucket}/missing/prefix)",
        )
        needle2 = "no data file at"

    r = hsextract(run_args(tmp_path, tiny_model, [str(good), source], s3), cli_env())

    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and needle2 in r.stderr and "Traceback" not in r.stderr
    run_dir = tmp_path / "run"
    assert not (run_dir / "plan.json").exists() and not (run_dir / "tokens.safetensors").exists()
    assert not (run_dir / "logs").exists()  # no worker started, so no weight was loaded
    assert not list((tmp_path / "out").glob("shard-*"))


SECRET = "sEcReT-never-printed-7f3a"
KEY_ID = "AKIDHSXNEVERPRINTED"


def leaked(root: Path, *texts: str, secrets: tuple[str, ...] = (KEY_ID, SECRET)) -> list[str]:
    """Where the credentials appear: the texts given, and every file under ``root``."""
    places = [f"text {i}" for i, t in enumerate(texts) if any(x in t for x in secrets)]
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if any(x.encode() in data for x in secrets):
                places.append(str(path))
    return places


def test_an_s3_source_changed_or_deleted_before_the_resume_is_named_and_no_secret_is_kept(
    tmp_path, tiny_model, s3: S3Endpoint, s3_bucket: str
):
    """A run over an S3 source with distinctive credentials in the environment: they appear in no file of the run
    dir or output, no log, no message, no status page. The object changed before the rerun is refused naming it;
    the object deleted is named as the data the run was prepared from."""
    rows = make_conversations(6, seed=26)
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    client = s3.client()
    client.put_object(Bucket=s3_bucket, Key="src/rows.jsonl", Body=body)
    creds = s3.create_credentials()  # keys the server knows, and that nothing of the run may repeat
    secrets = (creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"])
    env = cli_env(**creds)
    args = run_args(tmp_path, tiny_model, [f"s3://{s3_bucket}/src/rows.jsonl"], s3)

    r = hsextract(args, env)

    assert r.returncode == 0, r.stdout + r.stderr
    shown = hsextract(["status", tmp_path / "run"], env)
    shown_json = hsextract(["status", tmp_path / "run", "--json"], env)
    assert shown.returncode == 0 and shown_json.returncode == 0
    assert leaked(tmp_path, r.stdout, r.stderr, shown.stdout, shown_json.stdout, secrets=secrets) == []

    client.put_object(Bucket=s3_bucket, Key="src/rows.jsonl", Body=body.replace(b"a", b"b", 1))
    r = hsextract(args, env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "holds a different plan" in r.stderr
    assert f"data file s3://{s3_bucket}/src/rows.jsonl changed (ETag " in r.stderr

    client.delete_object(Bucket=s3_bucket, Key="src/rows.jsonl")
    r = hsextract(args, env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"no data file at s3://{s3_bucket}/src/rows.jsonl" in r.stderr
    assert "was prepared from this data: to resume it, put the data back as it was" in r.stderr
    assert "Traceback" not in r.stderr
    assert leaked(tmp_path, r.stdout, r.stderr, secrets=secrets) == []


def test_credentials_in_a_source_url_are_refused_and_never_printed_or_kept(
    tmp_path, tiny_model, s3: S3Endpoint, s3_bucket: str
):
    args = run_args(tmp_path, tiny_model, [f"s3://{KEY_ID}:{SECRET}@{s3_bucket}/src/rows.jsonl"], s3)
    r = hsextract(args, cli_env())
    assert r.returncode == 2, r.stdout + r.stderr
    assert "carries credentials in its URL" in r.stderr and "Traceback" not in r.stderr
    assert leaked(tmp_path, r.stdout, r.stderr) == []
    assert not (tmp_path / "run" / "plan.json").exists()
