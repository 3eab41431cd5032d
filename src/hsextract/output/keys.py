"""Names of shards and batch files."""

from __future__ import annotations


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def batch_key(shard: int, batch_id: int) -> str:
    """The output key (and staging-relative path) of a batch file."""
    return f"{shard_name(shard)}/batch-{batch_id:06d}.safetensors"


def parse_batch_key(key: str) -> tuple[int | None, int | None]:
    """The shard and batch id a batch key names (``batch_key``'s inverse); None for a part it does not name."""
    import re

    m = re.fullmatch(r"shard-(\d{5,})/batch-(\d{6,})\.safetensors", key)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)
