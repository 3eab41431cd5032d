"""The job files of an output (``hsextract/plan.json``, ``run.json``, ``sample_ids.json``, ``data_report.json``
and the claim ``job.json``) prove themselves, and the batch files are the evidence: when a job file and the files
disagree, the job file is the suspect. A property over single edits: no edit of any job file makes ``finalize``
(what the run and ``hsextract finalize`` call) delete or rewrite a batch file, a completion record or the
manifest of a sound output; each edit is refused naming the file, or changes nothing."""

import json
import shutil
from pathlib import Path

import pytest
from support.damage import copy_output

from hsextract.errors import HsextractError
from hsextract.output.jobfiles import load_job_files
from hsextract.output.records import JOB, JOB_FILES, done_key, sample_ids_checksum
from hsextract.run.launcher import finish_output
from hsextract.storage.local import LocalSink
from hsextract.validation import seal

JOB_RECORDS = [*JOB_FILES.values(), JOB]


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file of the output but the job files, by path."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and str(p.relative_to(out)) not in JOB_RECORDS
    }


def leaves(value, path=()):
    """Every place in a JSON value an edit can reach: (path, value) of each scalar, list and object."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):  # the first few items stand for the rest
            yield from leaves(v, (*path, i))


def edits_of(value, path):
    """Single right-typed (and a few wrong-typed) edits of the item at ``path``: each returns a new value."""

    def at(doc, fn):
        doc = json.loads(json.dumps(doc))
        if not path:
            return fn(doc)
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        parent[path[-1]] = fn(parent[path[-1]])
        return doc

    def drop(doc):
        doc = json.loads(json.dumps(doc))
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        del parent[path[-1]]
        return doc

    item = value
    for p in path:
        item = item[p]
    found = []
    if isinstance(item, bool):
        found.append(("flipped", lambda d: at(d, lambda x: not x)))
    elif isinstance(item, int):
        found += [("+1", lambda d: at(d, lambda x: x + 1)), ("negative", lambda d: at(d, lambda x: -5))]
        found.append(("as string", lambda d: at(d, str)))
    elif isinstance(item, str):
        found.append(("changed", lambda d: at(d, lambda x: x[:-1] + ("0" if x[-1:] != "0" else "1"))))
    elif isinstance(item, list) and len(item) > 1 and item[0] != item[1]:
        found.append(("two swapped", lambda d: at(d, lambda x: [x[1], x[0], *x[2:]])))
    if path and isinstance(path[-1], str):
        found.append(("key removed", drop))
    return found


def all_edits(out: Path) -> list[tuple[str, str, object]]:
    """(record, description, new bytes) for a deterministic sample of every single edit of every job record."""
    found = []
    for name in JOB_RECORDS:
        value = json.loads((out / name).read_text())
        for path, _ in leaves(value):
            for what, fn in edits_of(value, path):
                found.append((name, f"{'.'.join(map(str, path)) or '(root)'} {what}", json.dumps(fn(value))))
        for what, body in [("truncated", (out / name).read_text()[:-9]), ("null", "null"), ("a list", "[]")]:
            found.append((name, what, body))
        found.append((name, "a directory", None))
    return found


def apply(out: Path, name: str, body: str | None) -> bytes:
    path = out / name
    before = path.read_bytes()
    path.unlink()
    if body is None:
        path.mkdir()
    else:
        path.write_text(body)
    return before


def restore(out: Path, name: str, before: bytes) -> None:
    path = out / name
    if path.is_dir():
        shutil.rmtree(path)
    path.write_bytes(before)


@pytest.mark.slow  # 3-6 s: the fast tier's budget (60 s on 2 cores)
def test_no_single_edit_of_a_job_record_removes_or_rewrites_a_sound_file(written_output, tmp_path):
    out = copy_output(written_output, tmp_path / "out")
    sound = snapshot(out)
    edits = all_edits(out)
    passed = []
    for name, what, body in edits:
        before = apply(out, name, body)
        said = []
        try:
            code, todo = finish_output(LocalSink(out), echo=said.append)
        except HsextractError as e:
            assert "\n" not in str(e) and name.split("/")[-1] in str(e), (name, what, str(e))
        else:
            # Only an edit that changes no value the job depends on may pass: the output stays complete.
            assert (code, todo) == (0, set()), (name, what, said)
            passed.append((name, what))
        assert snapshot(out) == sound, (name, what, said)
        restore(out, name, before)
    # Only the claim's record of who started the job is not the job's: its edits are seen, but change nothing.
    assert len(edits) > 150 and passed == [], passed


@pytest.mark.parametrize(
    "name,edit",
    [
        ("hsextract/plan.json", lambda d: {**d, "batches": swap_samples(d["batches"])}),
        ("hsextract/run.json", lambda d: {**d, "layer_ids": [0, 1, 2]}),
        ("hsextract/run.json", lambda d: {**d, "hidden_size": d["hidden_size"] * 2}),
        ("hsextract/run.json", lambda d: {**d, "vocab_size": 10**6}),
        ("hsextract/sample_ids.json", lambda d: [d[1], d[0], *d[2:]]),
        ("hsextract/data_report.json", lambda d: {**d, "kept": -5}),
    ],
    ids=[
        "plan-swapped",
        "run-layer_ids",
        "run-hidden_size",
        "run-vocab",
        "sample_ids-swapped",
        "report-kept",
    ],
)
def test_a_right_typed_edit_is_refused_by_name_by_finalize_and_verify_and_nothing_is_deleted(
    written_output, tmp_path, name, edit
):
    out = copy_output(written_output, tmp_path / "out")
    sound = snapshot(out)
    (out / name).write_text(json.dumps(edit(json.loads((out / name).read_text()))))
    with pytest.raises(HsextractError, match=f"{name}.*(damaged|does not match).*nothing was changed"):
        finish_output(LocalSink(out), echo=lambda *_: None)
    with pytest.raises(HsextractError, match=name):
        load_job_files(LocalSink(out))
    assert snapshot(out) == sound


def swap_samples(batches):
    """The first sample of batch 0 and of batch 1 traded: every field right-typed, the plan still whole."""
    a, b = json.loads(json.dumps(batches[:2]))
    a[4][0], b[4][0] = b[4][0], a[4][0]
    return [a, b, *batches[2:]]


def test_job_files_edited_with_their_checksums_still_never_cost_a_sound_batch(written_output, tmp_path):
    """Two samples swapped in sample_ids.json and its checksum in run.json resealed by hand: every job file proves
    itself, and the batch files' own headers are the evidence. finalize refuses naming the batch file and the job
    files, and deletes nothing; verify says the manifest and the files disagree."""
    out = copy_output(written_output, tmp_path / "out")
    sound = snapshot(out)
    ids = json.loads((out / JOB_FILES["samples"]).read_text())
    raw = json.dumps([ids[1], ids[0], *ids[2:]]).encode()
    (out / JOB_FILES["samples"]).write_bytes(raw)
    info = json.loads((out / JOB_FILES["info"]).read_text())
    info["sample_ids_sha256"] = sample_ids_checksum(raw)
    (out / JOB_FILES["info"]).write_text(json.dumps(seal(info)))
    said = []
    with pytest.raises(
        HsextractError, match="sound by its own header and checksums.*nothing was changed"
    ) as e:
        finish_output(LocalSink(out), echo=said.append)
    assert "sample_ids.json" in str(e.value) and "\n" not in str(e.value)
    assert snapshot(out) == sound, said
    assert all((out / done_key(k)).is_file() for k in sound if k.startswith("shard-"))
