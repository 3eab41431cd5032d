"""The run configuration: one dataclass that the CLI fills and that YAML files in ``configs/`` load into.

Every default lives here and nowhere else. The launcher writes the resolved config to ``<run_dir>/config.json``;
workers read it back from there, so a worker process never re-parses command-line options.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from .errors import HsextractError
from .rundir import write_json

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPES = tuple(DTYPE_BYTES)
TOO_LONG_POLICIES = ("truncate", "skip")


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    model: str
    """Local checkpoint directory or hub id of the target model (any transformers causal LM)."""

    data: str
    """JSONL, JSON, Parquet file or a `datasets.save_to_disk` directory."""

    output: str
    """Local directory or ``s3://bucket/prefix`` that receives the batch files."""

    run_dir: str
    """Local directory for the plan, token cache, logs and progress markers. Reruns resume from it."""

    layers: tuple[int, ...] | str = "dflash"
    """0-based ids of decoder layers whose OUTPUT is captured (= HF ``output_hidden_states[k + 1]``), or a
    preset: ``dflash`` (5 evenly spaced layers, 1..N-3) or ``eagle3`` (1, N//2-1, N-4)."""

    max_length: int = 4096
    """Samples longer than this many tokens are truncated or skipped (``too_long``)."""

    too_long: str = "truncate"
    """``truncate`` keeps the first ``max_length`` tokens, ``skip`` drops the sample. Both are counted."""

    max_tokens_per_batch: int = 65536
    """Bound on rows x longest row of a batch (padded tokens)."""

    max_rows: int = 512
    """Bound on rows per batch: flash-linear-attention's launch grid breaks at a few thousand rows."""

    shards: int = 1
    """Worker processes, one per GPU."""

    gpus: tuple[int, ...] | None = None
    """GPU indices for the shards (default 0..shards-1)."""

    device: str = "cuda"
    """``cuda`` or ``cpu`` (tests and the embedded demo)."""

    dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"

    staging: str | None = None
    """Where batch files are written before upload; default ``/dev/shm/hsextract/<run name>``."""

    staging_max_gb: float = 16.0
    """Staged bytes per shard at which its worker waits for the uploader to drain."""

    s3_endpoint_url: str | None = None
    """For S3-compatible stores; ``AWS_ENDPOINT_URL_S3`` is honoured too."""

    num_proc: int = 4
    """Processes that tokenize the dataset."""

    pinned_buffers: int = 3
    """Host buffers per worker that device-to-host copies land in; bounds host memory and how far the GPU runs
    ahead of the writer."""

    prewarm: bool = True
    """On GPUs with flash-linear-attention: compile its kernels once into a shared Triton cache before the shards
    start, instead of every shard compiling them at once."""

    random_weights: bool = False
    """Benchmarks only: build the architecture from ``model`` (a config) with random weights. ``run`` refuses it."""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise HsextractError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.too_long not in TOO_LONG_POLICIES:
            raise HsextractError(f"--too-long {self.too_long!r} is not one of {', '.join(TOO_LONG_POLICIES)}")
        for name in (
            "max_length",
            "max_tokens_per_batch",
            "max_rows",
            "shards",
            "num_proc",
            "pinned_buffers",
        ):
            if getattr(self, name) < 1:
                raise HsextractError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.max_length > self.max_tokens_per_batch:
            raise HsextractError(
                f"--max-length {self.max_length} exceeds --max-tokens-per-batch {self.max_tokens_per_batch}: "
                "a sample that long could never fit in a batch; lower --max-length or raise the batch budget"
            )
        if self.gpus is not None and len(self.gpus) < self.shards:
            raise HsextractError(f"--gpus lists {len(self.gpus)} GPUs for {self.shards} shards")
        if self.device not in ("cuda", "cpu"):
            raise HsextractError(f"--device must be cuda or cpu, got {self.device!r}")
        if self.staging_max_gb <= 0:
            raise HsextractError("--staging-max-gb must be positive")

    @property
    def staging_dir(self) -> Path:
        if self.staging:
            return Path(self.staging)
        return Path("/dev/shm/hsextract") / Path(self.run_dir).resolve().name

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RunConfig:
        d = dict(d)
        for key in ("layers", "gpus"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)

    def save(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        return cls.from_json(json.loads(Path(path).read_text()))


def load_yaml(path: str | Path) -> dict:
    """Options from a YAML file in ``configs/``; keys are RunConfig field names (``-`` or ``_``)."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise HsextractError(f"config file {path} does not exist") from None
    if not isinstance(raw, dict):
        raise HsextractError(f"config file {path} must hold a mapping of option: value")
    known = {f.name for f in dataclasses.fields(RunConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise HsextractError(f"config file {path}: unknown option {key!r}")
        out[name] = tuple(value) if isinstance(value, list) else value
    return out
