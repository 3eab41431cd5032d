"""What a run owns (run/rundir.py ``owning_shards``, the launcher's staging clean-up): a second run of the same
shards is refused in one line naming the first, and a run on its way out removes only its own shards' empty staging
directories. The concurrent runs themselves, in real processes: tests/scenarios/test_concurrent_runs.py."""

import os
import socket

import pytest

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.run.launcher import remove_empty_staging
from hsextract.run.rundir import RunDir


def test_a_second_owner_of_a_shard_is_refused_naming_the_first_and_other_shards_stay_free(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    with run_dir.owning_shards([0, 1], "out"):
        with pytest.raises(HsextractError) as e:
            with run_dir.owning_shards([1], "out"):
                pass
        message = str(e.value)
        assert "\n" not in message and "being written by another hsextract run" in message
        assert f"pid {os.getpid()} on {socket.gethostname()}" in message and "shard 1" in message
        assert run_dir.shards_in_use([1]) == f"pid {os.getpid()} on {socket.gethostname()}"
        with run_dir.owning_shards([2], "out"):  # another shard of the run dir is another run's to own
            pass
    assert run_dir.shards_in_use([0, 1]) == ""  # released with the block
    with run_dir.owning_shards([1], "out"):
        pass


def test_a_run_on_its_way_out_removes_only_its_own_empty_staging_directories(tmp_path):
    cfg = RunConfig(
        model="m",
        data="d",
        output=str(tmp_path / "out"),
        run_dir=str(tmp_path / "run"),
        staging=str(tmp_path / "staging"),
        shards=3,
    )
    for shard in range(3):
        (cfg.staging_dir / f"shard-{shard:05d}").mkdir(parents=True)
    remove_empty_staging(cfg, [0])
    assert sorted(p.name for p in cfg.staging_dir.iterdir()) == ["shard-00001", "shard-00002"]
    remove_empty_staging(cfg, [1, 2])
    assert not cfg.staging_dir.exists()  # the last owner out leaves no empty directory
