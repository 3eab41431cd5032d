"""One ``hsextract run`` on this node, in order: the places and files checked (preflight.py), start-up begun (the
early workers' imports and CUDA start-up overlap the rest of the preflight), the preflight's data, plan and
acceptance, then the shards and, last, the manifest (launcher.py)."""

from __future__ import annotations

import time

from hsextract.config import RunConfig
from hsextract.run.launcher import begin_startup, chosen_shards, launch
from hsextract.run.preflight import check_places_and_files, prepare_checked
from hsextract.run.rundir import RunDir


def run_job(
    cfg: RunConfig,
    *,
    restart: bool = False,
    only_shards=None,
    show_progress: bool = True,
    echo=print,
    confirm=None,
) -> int:
    """Prepare and run this node's shards; returns the exit code (``launch``'s). ``confirm(question)``: whether a
    ``restart`` may delete a finished output (None: it may not)."""
    t0 = time.time()
    run_dir, shards = RunDir(cfg.run_dir), chosen_shards(cfg, only_shards)
    with run_dir.launcher_lock(exclusive=restart), run_dir.owning_shards(shards, cfg.output):
        check_places_and_files(cfg)
        with begin_startup(cfg, shards) as startup:
            with run_dir.preparing(echo):  # a run of other shards of this run dir prepares before or after
                plan = prepare_checked(
                    cfg, restart=restart, echo=echo, show_progress=show_progress, confirm=confirm
                )
            echo(
                f"prepared in {time.time() - t0:.1f} s; starting {cfg.shards} shard(s), logs in {cfg.run_dir}/logs"
            )
            return launch(
                cfg, plan, only_shards=only_shards, show_progress=show_progress, echo=echo, startup=startup
            )
