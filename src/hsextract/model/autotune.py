"""Autotuned configs pinned per setup, not per token count, for flash-linear-attention's norm kernels.

FLA's ``l2norm_fwd_kernel`` (the q/k l2 norm of the Gated-DeltaNet rule) and ``layer_norm_gated_fwd_kernel`` (the
gated RMSNorm) key their autotuning on ``NB = cdiv(rows, 2048)``, so every new batch size autotunes them again:
25 and 90 configs compiled and timed, 9.6 s and 3.2 s on an H200 (docs/PERFORMANCE.md). ``NB`` is not read in
the kernels' bodies: it only buckets the token count for the tuner. ``pin_token_count_autotune`` drops it from
their autotune keys in this process, so the first tuning (the warm-up runs the plan's largest batch first)
serves every token count; a new count then costs one compile of the chosen config, cached in the kernel cache
for every later job. Results do not change: any config computes the same normalisation of each row.

``HSEXTRACT_PIN_AUTOTUNE=0`` keeps FLA's keys. The warm-up and every worker call this before their first forward
(model/load.py, model/warmup.py); both must agree, which the stamp's model signature records.
"""

from __future__ import annotations

import importlib
import logging
import os

log = logging.getLogger(__name__)


PIN_ENV = "HSEXTRACT_PIN_AUTOTUNE"


TOKEN_COUNT_KEY = "NB"


PINNED_MODULES = ("fla.modules.l2norm", "fla.modules.fused_norm_gate")


def pin_enabled(env=None) -> bool:
    return (os.environ if env is None else env).get(PIN_ENV, "1") != "0"


def pin_token_count_autotune(modules=PINNED_MODULES) -> list[str]:
    """Drop ``NB`` from the autotune key of every autotuned kernel of ``modules``; the names changed. Nothing
    when disabled, when FLA is absent, or when Triton's autotuner keeps its key elsewhere than ``keys``."""
    if not pin_enabled():
        return []
    pinned = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # absent (CPU), or failing to import: the forward meets the same and says so
            continue
        for name, obj in sorted(vars(module).items()):
            tuner = _autotuner(obj)
            keys = getattr(tuner, "keys", None)
            if isinstance(keys, list) and TOKEN_COUNT_KEY in keys:
                tuner.keys = [k for k in keys if k != TOKEN_COUNT_KEY]
                pinned.append(name)
    if pinned:
        log.info("autotune keys without the token count: %s", ", ".join(pinned))
    return pinned


def _autotuner(obj, depth: int = 4):
    """The Triton ``Autotuner`` that ``obj`` is or wraps (``triton.heuristics`` on top keeps it in ``.fn``), also a
    subclass of it (fla 0.6's ``l2norm_fwd_kernel`` is a ``CachedAutotuner``, which an H200 run showed unpinned)."""
    for _ in range(depth):
        if obj is None or any(c.__name__ == "Autotuner" for c in type(obj).__mro__):
            return obj
        obj = getattr(obj, "fn", None)
    return None
