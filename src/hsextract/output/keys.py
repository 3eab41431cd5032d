"""Names of shards and batch files."""

from __future__ import annotations


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def batch_key(shard: int, batch_id: int) -> str:
    """The output key (and staging-relative path) of a batch file."""
    return f"{shard_name(shard)}/batch-{batch_id:06d}.safetensors"
