"""The kernel cache: Triton's compiled kernels and autotune results, shared by every job of a user on a machine.

Compiling and autotuning FLA's kernels is the same for every job with the same GPU and software, so it lives per
user, not per run: ``<root>/<key>/`` is every process's ``TRITON_CACHE_DIR``, with ``key.json`` and the stamps of
what the warm-ups have run, so that a job whose plan needs nothing more skips the warm-up. No torch: the launcher
uses it.
"""

# ``root`` is ``--kernel-cache``, else ``$HSEXTRACT_KERNEL_CACHE``, else ``~/.cache/hsextract/triton``; ``key`` names
# the GPUs, driver and the versions of torch, Triton and FLA (``cpu`` on CPU); a ``TRITON_CACHE_DIR`` already set is
# used as it is. A stamp, ``hsextract-warm/<model signature>.json``, lists the token-count buckets (FLA's ``NB`` of
# the norm kernels' rows, fla_patch.py) and Triton's integer shape classes the warm-ups have run.

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from typing_extensions import TypedDict

from hsextract.errors import HsextractError
from hsextract.startup.warmup.fla_patch import NB_ROWS, package_version, patch_supported, pin_enabled
from hsextract.storage.fileio import atomic_write, cache_home
from hsextract.validation import parse

log = logging.getLogger(__name__)


KERNEL_CACHE_ENV = "HSEXTRACT_KERNEL_CACHE"


STAMP_DIR = "hsextract-warm"


# Distributions whose version changes what Triton compiles or which autotuned config is valid.
KEY_PACKAGES = ("torch", "triton", "fla-core", "flash-linear-attention", "liger-kernel")


@dataclass(frozen=True)
class KernelCache:
    dir: Path
    key: dict
    source: str
    """Where ``dir`` came from: ``--kernel-cache``, the environment variable's name, or ``default``."""


def gpu_inventory() -> list[dict]:
    """Name and driver of each GPU ``nvidia-smi`` lists (no CUDA context is made); [] when it cannot tell."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if r.returncode != 0:
        return []
    gpus = []
    for line in r.stdout.splitlines():
        name, _, driver = line.rpartition(",")
        if name.strip():
            gpus.append({"name": name.strip(), "driver": driver.strip()})
    return gpus


def setup_key(device: str, gpus: list[dict] | None = None, packages: dict | None = None) -> dict:
    """What a compiled kernel depends on, beyond its source: ``{"device": "cpu"}`` on CPU; on CUDA the distinct
    GPU names, the driver and the versions of ``KEY_PACKAGES`` (torch's carries its CUDA build, e.g. +cu130).
    ``gpus`` and ``packages`` default to what this machine has."""
    if device != "cuda":
        return {"device": "cpu"}
    gpus = gpu_inventory() if gpus is None else gpus
    if packages is None:
        packages = {p: package_version(p) for p in KEY_PACKAGES}
    return {
        "device": "cuda",
        "gpus": sorted({g["name"] for g in gpus}) or ["unknown"],
        "driver": sorted({g["driver"] for g in gpus}) or ["unknown"],
        **{p: v for p, v in sorted(packages.items()) if v is not None},
    }


def key_name(key: dict) -> str:
    """A directory name for ``key``: ``cpu``, or the GPU's name made safe plus a hash of the whole key."""
    if key.get("device") != "cuda":
        return "cpu"
    gpu = "+".join(key.get("gpus", ["unknown"]))
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu.lower().removeprefix("nvidia ")).strip("-")[:40] or "gpu"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return f"{slug}-{digest}"


def default_root(env=None) -> Path:
    return cache_home(env) / "triton"


def resolve(option: str | None, device: str, env=None, key: dict | None = None) -> KernelCache:
    """The kernel cache a run uses: ``option`` (``--kernel-cache``) or ``$HSEXTRACT_KERNEL_CACHE`` as the root,
    keyed; else a ``TRITON_CACHE_DIR`` already set, as it is; else the default root, keyed."""
    env = os.environ if env is None else env
    key = setup_key(device) if key is None else key
    if option:
        root, source = Path(option).expanduser(), "--kernel-cache"
    elif env.get(KERNEL_CACHE_ENV):
        root, source = Path(env[KERNEL_CACHE_ENV]).expanduser(), KERNEL_CACHE_ENV
    elif env.get("TRITON_CACHE_DIR"):
        return KernelCache(Path(env["TRITON_CACHE_DIR"]).expanduser().absolute(), key, "TRITON_CACHE_DIR")
    else:
        root, source = default_root(env), "default"
    return KernelCache(root.absolute() / key_name(key), key, source)


def prepare(kc: KernelCache) -> None:
    """Create the directory (and its ``key.json``); a clear error if it cannot be written."""
    try:
        kc.dir.mkdir(parents=True, exist_ok=True)
        if not (kc.dir / "key.json").exists():
            atomic_write(kc.dir / "key.json", json.dumps(kc.key, indent=1, sort_keys=True))
    except OSError as e:
        raise HsextractError(
            f"kernel cache {kc.dir} (from {kc.source}) cannot be written ({e.strerror or e}): choose another "
            f"directory with --kernel-cache or {KERNEL_CACHE_ENV}"
        ) from None


def check_writable(kc: KernelCache) -> None:
    """Before any work: the directory, or the nearest existing one above it, can be written (creates nothing)."""
    place = kc.dir
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir() or not os.access(place, os.W_OK | os.X_OK):
        raise HsextractError(
            f"kernel cache {kc.dir} (from {kc.source}) cannot be created: {place} is not a writable directory; "
            f"choose another directory with --kernel-cache or {KERNEL_CACHE_ENV}"
        )


def write_pointer(path: Path, kc: KernelCache) -> None:
    """The run dir's note of the kernel cache it used."""
    atomic_write(path, json.dumps({"dir": str(kc.dir), "source": kc.source, "key": kc.key}, indent=1))


def read_pointer(path: Path) -> Path | None:
    try:
        return Path(json.loads(Path(path).read_text())["dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- what a plan needs warmed ----------------------------------------------------------------------------------


SIGNATURE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "partial_rotary_factor",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "full_attention_interval",
)


FUSED_SOURCES = ("qwen3_5.py", "triton_kernels.py")

"""hsextract's modules (in ``hsextract.model``) that decide which kernels the fused forward launches."""


def fused_source_hash() -> str:
    """A short hash of the fused forward's own source: another hsextract whose fused forward launches other kernels
    (the MLP's gate and up joined into one GEMM, say) must not take an older version's stamp as warm."""
    digest = hashlib.sha256()
    for name in FUSED_SOURCES:
        digest.update((Path(__file__).parents[2] / "model" / name).read_bytes())
    return digest.hexdigest()[:16]


def model_signature(
    text_config, *, kernel_mode: str, dtype: str, attn_implementation: str, pinned: bool | None = None
) -> str:
    """What decides which kernels a forward compiles (layer shapes, not depth; for the fused kernels, their
    source; FLA's token bucket), and how (``pinned``: the autotune keys without the token count, fla_patch.py;
    by default as this process would): a short hash."""
    if pinned is None:
        pinned = pin_enabled() and patch_supported()
    shape = {f: getattr(text_config, f, None) for f in SIGNATURE_FIELDS}
    types = getattr(text_config, "layer_types", None) or []
    shape["layer_types"] = sorted(set(types))
    facts = {**shape, "kernels": kernel_mode, "dtype": dtype, "attn": attn_implementation, "pinned": pinned}
    facts["nb_rows"] = NB_ROWS
    if kernel_mode == "fused":
        facts["fused_source"] = fused_source_hash()
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def bucket_heads(text_config, kernel_mode: str) -> tuple[int, ...]:
    """Heads per token of the rows FLA's ``NB``-keyed kernels see: the q/k l2 norm (the key heads when fused,
    grouped; the value heads in transformers' stock path, which repeats q and k) and the gated norm (the value
    heads). () for a model without Gated-DeltaNet layers."""
    hk = getattr(text_config, "linear_num_key_heads", None)
    hv = getattr(text_config, "linear_num_value_heads", None)
    if not hk or not hv:
        return ()
    return (hk if kernel_mode == "fused" else hv, hv)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_bucket(padded_tokens: int, heads: tuple[int, ...]) -> tuple[int, ...]:
    """FLA's autotune key ``NB`` for each of ``heads`` (rows = tokens x heads)."""
    return tuple(cdiv(padded_tokens * h, NB_ROWS) for h in heads)


def shape_class(rows: int, padded_length: int) -> tuple[bool, bool, bool, bool]:
    """Triton compiles a kernel once per integer argument equal to 1 or divisible by 16 (and once for the
    rest): a batch's class by its row count and padded length."""
    return (rows == 1, rows % 16 == 0, padded_length == 1, padded_length % 16 == 0)


@dataclass
class WarmSet:
    """Token-count buckets and shape classes: what a plan needs, or what a stamp says is warm."""

    buckets: set = field(default_factory=set)
    classes: set = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.buckets or self.classes)

    def minus(self, other: WarmSet) -> WarmSet:
        return WarmSet(self.buckets - other.buckets, self.classes - other.classes)

    def union(self, other: WarmSet) -> WarmSet:
        return WarmSet(self.buckets | other.buckets, self.classes | other.classes)

    def to_json(self) -> dict:
        return {
            "buckets": sorted(list(b) for b in self.buckets),
            "classes": sorted(list(c) for c in self.classes),
        }

    @classmethod
    def from_json(cls, d) -> WarmSet:
        """The set a stamp holds; ValueError naming the field when it is not one (``validation.py``)."""
        record = parse(StampJson, d, ValueError)
        return cls(
            buckets={tuple(b) for b in record["buckets"]}, classes={tuple(c) for c in record["classes"]}
        )


class StampJson(TypedDict):
    """A warm stamp as JSON: FLA's autotune keys (integers, one per head count) and shape classes (four flags)."""

    __pydantic_config__ = {"extra": "forbid"}  # type: ignore[misc]
    buckets: list[list[int]]
    classes: list[tuple[bool, bool, bool, bool]]


def batch_needs(rows: int, padded_length: int, heads: tuple[int, ...]) -> WarmSet:
    buckets = {token_bucket(rows * padded_length, heads)} if heads else set()
    return WarmSet(buckets, {shape_class(rows, padded_length)})


def plan_needs(shapes, heads: tuple[int, ...]) -> WarmSet:
    """What batches of these shapes (``rows``, ``padded_length``) need warmed."""
    need = WarmSet()
    for rows, padded_length in shapes:
        need = need.union(batch_needs(rows, padded_length, heads))
    return need


def stamp_path(cache_dir: Path, signature: str) -> Path:
    return Path(cache_dir) / STAMP_DIR / f"{signature}.json"


def read_stamp(cache_dir: Path, signature: str) -> WarmSet:
    """What earlier warm-ups in this cache compiled for this model signature; empty if none (or unreadable)."""
    try:
        return WarmSet.from_json(json.loads(stamp_path(cache_dir, signature).read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return WarmSet()


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def add_to_stamp(cache_dir: Path, signature: str, warmed: WarmSet) -> WarmSet:
    """Record ``warmed`` (after a successful warm-up), merged with what the stamp held; returns the new stamp.
    Locked, so that two jobs finishing at once both count."""
    path = stamp_path(cache_dir, signature)
    with _locked(path):
        merged = read_stamp(cache_dir, signature).union(warmed)
        atomic_write(path, json.dumps(merged.to_json()))
    return merged
