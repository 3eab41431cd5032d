"""Autotune choices recorded once per GPU model, so that no run times a kernel's candidate configs again.

FLA autotunes most of its Triton kernels on the first call with a new key, and keeps the choice only in the
process's memory; the choice depends on the GPU model and the kernel, not on the weights or the data. ``record``
writes the choices of a process (the warm-up's), ``install`` fills every autotuner from the tables before the first
forward: Triton then compiles the one chosen config and times nothing. No torch or Triton at module import.
"""

# - ``record(path)`` writes, for every autotuned kernel of the process that has chosen a config, the choice per key:
#   ``{"module:name": {"src": hash of its source, "entries": [[key, config], ...]}}``. The warm-up records into the
#   kernel cache (``<TRITON_CACHE_DIR>/hsextract-tuned.json``) after its forwards.
# - ``install()`` reads the kernel cache's table, then the one shipped with hsextract for this GPU model and Triton
#   version (``autotune_tables/<gpu>.json`` beside this module, made on that GPU by ``scripts/gpu_session.sh
#   startup``). A key the table lacks takes the entry of the same kernel whose key differs only in numbers the table
#   saw vary (token counts), nearest in log scale; a number the table never saw vary (a head dim, a head count) must
#   match exactly, and a kernel whose source changed is not used.
# A table chooses configs, never code: ``install`` imports only modules of the kernel packages (``KERNEL_PACKAGES``:
# FLA, liger, hsextract's own kernels) named as plain dotted identifiers, so a table naming ``os`` or ``this`` is
# ignored for that entry (a warning). A table file another user could write (not owned by this user or root, or
# writable by group or others: the rule ssh applies to its keys) is not read at all; ``record`` writes it 0644.
# Results do not depend on the config beyond float rounding of the reductions' order (the GPU tests compare the
# states with an HF forward either way). ``HSEXTRACT_TUNED=0`` leaves every autotuner as FLA made it; the autotuners
# themselves are reached through fla_patch.py; this runs only on CUDA.

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
import sys
from pathlib import Path

from hsextract.startup.warmup.fla_patch import (
    answer_from,
    autotuner_of,
    chosen,
    config_dict,
    jit_of,
    package_version,
    patch_supported,
    source_hash,
)
from hsextract.storage.fileio import atomic_write

log = logging.getLogger(__name__)


TUNED_ENV = "HSEXTRACT_TUNED"


TABLE_NAME = "hsextract-tuned.json"

"""The table a machine's warm-ups record, in the kernel cache directory (``TRITON_CACHE_DIR``)."""


SHIPPED_DIR = Path(__file__).with_name("autotune_tables")


KERNEL_PACKAGES = ("fla", "liger_kernel", "hsextract")

"""The packages whose modules a table may name: the only code ``install`` imports."""


MODULE_PREFIXES = tuple(f"{p}." for p in KERNEL_PACKAGES)


_KERNEL_ID = re.compile(
    r"^(?P<module>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+):(?P<name>[A-Za-z_][A-Za-z0-9_]*)$"
)


def kernel_module(kernel_id: str) -> tuple[str, str] | None:
    """``(module, name)`` of a table's ``"module:name"`` when the module is inside one of ``KERNEL_PACKAGES``;
    None for anything else (another package, a bare top-level module, a name that is not an identifier)."""
    match = _KERNEL_ID.match(kernel_id) if isinstance(kernel_id, str) else None
    if match is None or match["module"].partition(".")[0] not in KERNEL_PACKAGES:
        return None
    return match["module"], match["name"]


def writable_by_others(path: Path) -> str | None:
    """Why ``path`` could have been written by another user (its owner, its mode), or None when it could not."""
    st = path.stat()
    if st.st_uid not in (os.geteuid(), 0):
        return f"it is owned by uid {st.st_uid}, not by this user ({os.geteuid()}) or root"
    if st.st_mode & 0o022:
        return (
            f"its mode {st.st_mode & 0o777:o} lets {'others' if st.st_mode & 0o002 else 'its group'} write it"
        )
    return None


def tuned_enabled(env=None) -> bool:
    return (os.environ if env is None else env).get(TUNED_ENV, "1") != "0"


def gpu_file_name(gpu_name: str) -> str:
    """``NVIDIA H200`` -> ``NVIDIA_H200.json``."""
    return (re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_") or "unknown_gpu") + ".json"


def autotuners(prefixes=MODULE_PREFIXES):
    """``("module:name", tuner)`` for every autotuned kernel defined at the top of an imported module."""
    seen = set()
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not module_name.startswith(prefixes):
            continue
        for name, obj in sorted(vars(module).items()):
            tuner = autotuner_of(obj)
            if tuner is None or id(tuner) in seen:
                continue
            jit = jit_of(tuner)
            if jit is not None and getattr(jit, "module", module_name) != module_name:
                continue  # imported here from where it is defined: named by that module
            seen.add(id(tuner))
            yield f"{module_name}:{name}", tuner


def snapshot(prefixes=MODULE_PREFIXES) -> dict:
    """The choices every autotuner of the process has made so far, as a table's ``kernels``."""
    kernels = {}
    for kernel_id, tuner in autotuners(prefixes):
        entries = []
        for key, config in chosen(tuner):
            try:
                entry = json.loads(json.dumps([list(key), config_dict(config)]))
            except (TypeError, ValueError):  # a key or kwarg that is not plain data: not recordable
                continue
            entries.append(entry)
        if entries:
            kernels[kernel_id] = {"src": source_hash(tuner), "entries": entries}
    return kernels


def merge(old: dict, new: dict) -> dict:
    """``new``'s choices over ``old``'s, per kernel and key; a kernel whose source changed starts over."""
    out = {k: {"src": v.get("src"), "entries": list(v.get("entries", []))} for k, v in old.items()}
    for kernel_id, rec in new.items():
        mine = out.get(kernel_id)
        if mine is None or mine.get("src") != rec.get("src"):
            out[kernel_id] = {"src": rec.get("src"), "entries": list(rec["entries"])}
            continue
        by_key = {json.dumps(k): [k, c] for k, c in mine["entries"]}
        by_key.update({json.dumps(k): [k, c] for k, c in rec["entries"]})
        mine["entries"] = list(by_key.values())
    return out


def software() -> dict:
    return {dist: package_version(dist) for dist in ("triton", "fla-core")}


def record(path: str | os.PathLike, gpu_name: str) -> int:
    """Add this process's autotune choices to the table at ``path``; the number of kernels it holds."""
    path = Path(path)
    old = read_table(path) or {}
    kernels = merge(old.get("kernels", {}), snapshot())
    table = {"gpu": gpu_name, **software(), "kernels": kernels}
    data = json.dumps(table, indent=1, sort_keys=True).encode()
    atomic_write(path, lambda f: (os.fchmod(f.fileno(), 0o644), f.write(data)))  # writable by this user only
    return len(kernels)


def read_table(path: str | os.PathLike, *, trusted_only: bool = False) -> dict | None:
    """The table at ``path``; None when it is missing or unreadable, or (``trusted_only``) another user could
    have written it (logged)."""
    path = Path(path)
    try:
        if trusted_only and (why := writable_by_others(path)) is not None:
            log.warning(
                "autotune table %s not used: %s (chmod go-w it, or remove it; the next warm-up records a new one)",
                path,
                why,
            )
            return None
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return table if isinstance(table, dict) and isinstance(table.get("kernels"), dict) else None


def tables(gpu_name: str, cache_dir: str | None = None) -> list[dict]:
    """The tables that apply here, the machine's own first: the kernel cache's, then the shipped one for this GPU
    model when it was made with this Triton version."""
    found = []
    if cache_dir:
        t = read_table(Path(cache_dir) / TABLE_NAME, trusted_only=True)
        if t is not None:
            found.append(t)
    shipped = read_table(SHIPPED_DIR / gpu_file_name(gpu_name))
    if shipped is not None and shipped.get("triton") == software().get("triton"):
        found.append(shipped)
    return found


class Choices:
    """One kernel's recorded choices: exact keys, and the nearest for a key that differs only in numbers the
    recorded keys vary in."""

    def __init__(self, entries):
        self.exact = {}
        for key, config in entries:
            self.exact.setdefault(_as_key(key), config)
        keys = list(self.exact)
        self.varying = set()
        for i in range(max((len(k) for k in keys), default=0)):
            values = {k[i] for k in keys if len(k) > i}
            if len(values) > 1 and all(_is_number(v) for v in values):
                self.varying.add(i)

    def lookup(self, key: tuple):
        if key in self.exact:
            return self.exact[key]
        best, best_d = None, math.inf
        for k, config in self.exact.items():
            if len(k) != len(key):
                continue
            d = 0.0
            for i, (a, b) in enumerate(zip(k, key, strict=True)):
                if a == b and type(a) is type(b):
                    continue
                if i in self.varying and _is_number(a) and _is_number(b):
                    d += abs(math.log2(abs(a) + 1) - math.log2(abs(b) + 1))
                else:
                    d = math.inf
                    break
            if d < best_d:
                best, best_d = config, d
        return best


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_key(key) -> tuple:
    return tuple(tuple(v) if isinstance(v, list) else v for v in key)


def install(gpu_name: str, cache_dir: str | None = None) -> int:
    """Answer every autotuned kernel named in this machine's tables from them; the number of kernels answered.
    Kernels not imported yet are imported (they are the ones the recorded forward met)."""
    if not tuned_enabled() or not patch_supported():
        return 0
    merged: dict = {}
    for table in reversed(tables(gpu_name, cache_dir)):  # the machine's own choices win
        merged = merge(merged, table["kernels"])
    answered = 0
    for kernel_id, rec in merged.items():
        named = kernel_module(kernel_id)
        if named is None:
            log.warning(
                "autotune table entry %r not used: it names no kernel module of %s",
                kernel_id[:200],
                KERNEL_PACKAGES,
            )
            continue
        module_name, name = named
        try:
            module = importlib.import_module(module_name)
        except Exception:
            continue
        tuner = autotuner_of(getattr(module, name, None))
        if tuner is None or source_hash(tuner) != rec.get("src"):
            continue
        answer_from(tuner, Choices(rec["entries"]).lookup)
        answered += 1
    if answered:
        log.info("autotune choices from the recorded tables for %d kernels", answered)
    return answered


def install_here() -> int:
    """``install`` for this process's GPU and kernel cache; 0 without CUDA. A table that cannot be used is
    logged and left: the kernels then autotune as without it."""
    import torch

    if not torch.cuda.is_available():
        return 0
    try:
        return install(torch.cuda.get_device_name(), os.environ.get("TRITON_CACHE_DIR"))
    except Exception as e:
        log.warning("autotune tables not used (%r); kernels autotune as usual", e)
        return 0


def record_here(cache_dir: str | os.PathLike) -> int:
    """``record`` this process's choices into the kernel cache's table; 0 when that fails (logged)."""
    import torch

    try:
        return record(Path(cache_dir) / TABLE_NAME, torch.cuda.get_device_name())
    except Exception as e:
        log.warning("autotune choices not recorded (%r)", e)
        return 0
