"""Names of shards and batch files, and the rule every object key follows."""

from __future__ import annotations


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def batch_key(shard: int, batch_id: int) -> str:
    """The output key (and staging-relative path) of a batch file."""
    return f"{shard_name(shard)}/batch-{batch_id:06d}.safetensors"


def check_key(key: str) -> None:
    if not key or key.startswith("/") or "\\" in key or ".." in key.split("/"):
        raise ValueError(
            f"invalid object key {key!r}: expected a relative path such as 'shard-00000/batch-000000'"
        )
