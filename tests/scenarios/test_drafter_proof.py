"""The learning test: hsextract's states train a DFlash drafter that the real target accepts.

`scripts/bench_drafter.py --size test --variants untrained,hsextract` runs the chain on the real target
(SmolLM2-135M-Instruct from its PyPI package): `hsextract run` + the speculators seam trains speculators' DFlash
drafter, measured on held-out rows whose states come from a plain transformers forward (speculators' expected
accepted length, KL loss and per-position accuracy); the same forward over the training rows is the reference the
stored states and masks are compared with. The bounds come from the test size as measured (docs/DRAFTER.md), where
the bench's whole test size also trains the reference's drafter and the wrong extractions (`layer+1`, `token+1`):
with the states equal to the reference's, the same seed and batches train the same drafter, which the tier need
not repeat (three more drafters, about 100 s on 2 cores).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # ~3 min alone, longer beside the rest of the tier
ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("speculators", reason="the drafter trainer comes with scripts/setup.sh --test")
pytest.importorskip("dflash", reason="z-lab's dflash comes with scripts/setup.sh --test")
pytest.importorskip("gguf", reason="the real target needs the test extra's gguf")


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_drafter.py"),
            *("--size", "test", "--variants", "untrained,hsextract", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "table.json").read_text())["rows"]
    return {r["variant"]: r for r in rows}


def test_the_states_train_a_drafter_far_above_the_untrained_one(table):
    assert table["hsextract"]["eal"] > table["untrained"]["eal"] + 0.04, table
    assert table["hsextract"]["loss"] < table["untrained"]["loss"] / 4, table


def test_the_trainer_reads_the_reference_states_and_masks_from_hsextracts_output(table):
    """Every stored layer and the final state, as the trainer's data loading reads them, within float32 noise of the
    plain forward's, and not one supervised token different."""
    assert table["hsextract"]["states_rel_l2"] < 1e-5 and table["hsextract"]["mask_diff_tokens"] == 0, table
