"""Which node of a multi-node job this process is: from ``--nodes/--node-rank`` or the scheduler's environment.

No scheduler of our own: each node runs the same command, computes the same (deterministic) plan of N x S shards
and runs its own S (node R: shards R*S .. R*S+S-1). The sources, first found wins: the command line, SLURM
(``srun`` tasks, then a job array starting at 0), torchrun-style ``NNODES``/``NODE_RANK``, else a single node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hsextract.errors import HsextractError

_ENV_SOURCES = (
    ("SLURM_NNODES", "SLURM_NODEID"),
    ("SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_ID"),
    ("NNODES", "NODE_RANK"),
)


@dataclass(frozen=True)
class NodePlace:
    nodes: int
    rank: int
    source: str
    """Where the numbers came from, for the start-up line."""

    def describe(self) -> str:
        return f"node {self.rank} of {self.nodes} ({self.source})"


def node_place(nodes: int | None = None, rank: int | None = None, environ=None) -> NodePlace:
    """This node's place in the job; a clear error for inconsistent numbers. ``--nodes`` without ``--node-rank``
    takes the rank from the scheduler's environment, and is refused without one: every node would run as 0."""
    env = os.environ if environ is None else environ
    if rank is None and nodes is not None and nodes > 1:
        from_env = _env_place(env)
        if from_env is None:
            raise HsextractError(
                f"--nodes {nodes} without --node-rank, and no scheduler variable gives this node's rank "
                f"({', '.join(r for _, r in _ENV_SOURCES)}): give --node-rank 0..{nodes - 1}"
            )
        if from_env.nodes != nodes:
            raise HsextractError(
                f"--nodes {nodes} but {from_env.source} says {from_env.nodes} nodes: give --node-rank too, or "
                "drop --nodes"
            )
        place = NodePlace(nodes, from_env.rank, from_env.source)
    elif nodes is not None or rank is not None:
        place = NodePlace(
            nodes if nodes is not None else 1, rank if rank is not None else 0, "--nodes/--node-rank"
        )
    else:
        place = _env_place(env) or NodePlace(1, 0, "single node")
    if place.nodes < 1 or not 0 <= place.rank < place.nodes:
        raise HsextractError(
            f"node rank {place.rank} of {place.nodes} nodes (from {place.source}): the rank must be in 0..nodes-1"
        )
    return place


def _env_place(env) -> NodePlace | None:
    for count_var, rank_var in _ENV_SOURCES:
        if count_var in env and rank_var in env:
            try:
                return NodePlace(int(env[count_var]), int(env[rank_var]), f"{count_var}/{rank_var}")
            except ValueError:
                raise HsextractError(
                    f"{count_var}={env[count_var]!r} / {rank_var}={env[rank_var]!r} are not integers"
                ) from None
    return None
