"""``hsextract verify`` in a real process over a real run's output (conftest.finished_run, copied before damage):
an intact output verifies clean (exit 0); with one kind of real damage in each of ten files, it lists exactly
those files, each with its problem, and exits 1; a damaged manifest is named and exits non-zero. S3:
test_s3_end_to_end.py."""

import json

import pytest
from support.cli import run_cli
from support.damage import DAMAGES, copy_output, manifest_batches, manifest_without_batches, truncate_manifest


@pytest.fixture
def output(finished_run, tmp_path):
    return copy_output(finished_run[0] / "out", tmp_path / "out")


def test_intact_output_verifies_clean(output):
    r = run_cli("verify", output, "--workers", "3")
    assert r.returncode == 0
    batches = manifest_batches(output)
    assert f"verified {len(batches)} files" in r.stdout and "all good" in r.stdout
    assert "BAD" not in r.stdout
    report = json.loads(run_cli("verify", output, "--json").stdout)
    assert report["ok"] is True and report["bad"] == [] and report["files"] == len(batches)
    assert report["bytes"] == sum(b["size"] for b in batches)


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
