"""``hsextract verify`` (the command, in this process) over a real output (conftest.written_output, copied before
damage): an intact output verifies clean (exit 0); with one kind of real damage in each of ten files, it lists
exactly those files, each with its problem, and exits 1; a damaged manifest is named and exits non-zero. In a real
process and on S3: test_s3_end_to_end.py."""

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from support.damage import DAMAGES, copy_output, manifest_batches, manifest_without_batches, truncate_manifest

from hsextract.run.progress import format_bytes


@pytest.fixture
def output(written_output, tmp_path):
    return copy_output(written_output, tmp_path / "out")


def run_cli(*args, check=True):
    """``hsextract ARGS`` in this process: returncode, stdout and stderr, as from a real process."""
    from hsextract.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    if not isinstance(result.exception, SystemExit | None):
        raise result.exception
    assert not check or result.exit_code == 0, result.output
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def test_intact_output_verifies_clean(output):
    r = run_cli("verify", output, "--workers", "3")
    assert r.returncode == 0
    batches = manifest_batches(output)
    index = json.loads((output / "manifest.json").read_text())["sample_index"]  # checked as one more file
    size = format_bytes(sum(b["size"] for b in batches) + index["size"])
    assert f"verified {len(batches)} batch files and the sample index ({size}) of" in r.stdout, r.stdout
    assert "all good" in r.stdout
    assert "BAD" not in r.stdout
    report = json.loads(run_cli("verify", output, "--json").stdout)
    assert report["ok"] is True and report["bad"] == [] and report["files"] == len(batches) + 1
    assert report["bytes"] == sum(b["size"] for b in batches) + index["size"]


def test_verify_lists_exactly_the_damaged_files_with_their_problems(output):
    batches = manifest_batches(output)
    assert len(batches) > len(DAMAGES), "too few batch files for one damage each"
    # Every other file, so that intact files sit between damaged ones in every worker's share.
    damaged = {}
    for damage, entry in zip(DAMAGES, batches[::-1], strict=False):
        damage.apply(output / entry["key"])
        damaged[entry["key"]] = damage
    assert len(damaged) == len(DAMAGES)

    r = run_cli("verify", output, "--workers", "4", check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    bad_lines = [line for line in r.stdout.splitlines() if line.startswith("BAD ")]
    listed = {}
    for line in bad_lines:
        path, _, problem = line[len("BAD ") :].partition(": ")
        listed[path] = problem
    assert set(listed) == {str(output / key) for key in damaged}, r.stdout
    for key, damage in damaged.items():
        assert damage.verify_says in listed[str(output / key)], (damage.name, listed[str(output / key)])
    assert f"{len(DAMAGES)} bad" in r.stdout
    assert "Traceback" not in r.stderr

    report = json.loads(run_cli("verify", output, "--json", check=False).stdout)
    assert report["ok"] is False
    assert {b["key"] for b in report["bad"]} == set(damaged)


@pytest.mark.parametrize(
    "damage, says",
    [(truncate_manifest, "is not valid JSON"), (manifest_without_batches, "has no batch list")],
    ids=["truncated", "no-batches"],
)
def test_verify_names_a_damaged_manifest_and_fails(output, damage, says):
    damage(output)
    r = run_cli("verify", output, check=False)
    assert r.returncode == 2
    assert f"{output / 'manifest.json'}: {says}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def edit_manifest(out, edit) -> dict:
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    return manifest


LAYERS = (0, 1, 3)  # conftest.written_output's
RELABELLED = (0, 1, 2)


def relabel_layers(m):
    """Layer 3 relabelled 2 everywhere the manifest says it, so that only the batch headers disagree."""
    assert tuple(m["layer_ids"]) == LAYERS
    for field in ("layer_ids", "slot_layer_ids"):
        m[field] = [2 if k == 3 else k for k in m[field]]
    m["fingerprint"]["layer_ids"] = m["layer_ids"]


def drop_batch(m):
    m["num_samples"] -= len(m["batches"].pop(3)["sample_ids"])


def repeat_batch(m):
    m["batches"].insert(4, m["batches"][3])


@pytest.mark.parametrize(
    "edit, verify_says, reader_says",
    [
        (
            relabel_layers,
            "its header says layer_ids [0, 1, 3], the manifest [0, 1, 2]",
            "header says layer_ids",
        ),
        (drop_batch, "lists 15 batches, the plan 16; missing ['shard-0000", None),
        (repeat_batch, "twice", "twice"),
        (
            lambda m: m.update(layer_ids=list(RELABELLED)),
            "says layer_ids [0, 1, 2] but its fingerprint",
            "fingerprint",
        ),
    ],
    ids=["layer-ids", "batch-dropped", "batch-repeated", "layer-ids-only"],
)
def test_a_hand_edited_manifest_is_caught_by_verify_and_the_reader(output, edit, verify_says, reader_says):
    """verify exited 0 on each of these and the reader returned layer 3's states as layer 2, or a batch's
    samples too few or twice. The reader checks what it can as it opens each file; verify checks the manifest against the plan."""
    from hsextract.errors import CorruptOutputError
    from hsextract.output.reader import open_output

    edit_manifest(output, edit)
    r = run_cli("verify", output, check=False)
    assert r.returncode in (1, 2) and verify_says in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    if reader_says is None:
        return  # a consistent manifest without one batch: only the plan says so
    with pytest.raises(CorruptOutputError, match=reader_says.replace("[", r"\[")):
        out = open_output(output)
        for sample in out:
            assert 2 not in sample["layers"] or 3 in sample["layers"]


def test_temporary_files_of_killed_writes_are_removed_by_verify_and_finalize_and_a_live_ones_kept(output):
    """A SIGINT left `...json.tmp-...` in done/, which survived the resume and verify: a temporary file whose
    writer has gone (a dead process of this host, or another host's untouched for an hour) is removed and said; one
    a live process writes stays."""
    import os
    import subprocess

    from hsextract.storage.fileio import HOST, STALE_TMP_S

    record = sorted((output / "hsextract" / "done").rglob("*.json"))[0]
    child = subprocess.Popen(["true"])
    child.wait()
    dead = record.with_name(f"{record.name}.tmp-{HOST}-{child.pid}-{child.pid}")
    live = record.with_name(f"{record.name}.tmp-{HOST}-{os.getpid()}-1")
    old = record.with_name(f"{record.name}.tmp-4242-4243")  # an older hsextract's name, no host: by its age
    young = record.with_name(f"{record.name}.tmp-otherhost-7-8")
    for path in (dead, live, old, young):
        path.write_bytes(b'{"half": ')
    os.utime(old, (0, 0))
    r = run_cli("verify", output)
    rel = sorted(p.relative_to(output).as_posix() for p in (dead, old))
    assert (
        f"removed 2 temporary files that interrupted writes left in the output ({', '.join(rel)})" in r.stdout
    )
    assert not dead.exists() and not old.exists() and live.exists() and young.exists()
    assert "all good" in r.stdout
    os.utime(young, (0, os.path.getmtime(young) - STALE_TMP_S - 60))
    r = run_cli("finalize", output)
    assert "removed 1 temporary file that interrupted writes left in the output" in r.stdout, r.stdout
    assert not young.exists() and live.exists()
    assert "removed" not in run_cli("verify", output).stdout
