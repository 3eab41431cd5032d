"""Every reach into flash-linear-attention's and Triton's internals, for the FLA version it was written for.

Two results-neutral patches: ``pin_token_count_autotune`` drops the token-count bucket from the norm kernels'
autotune keys, so the first tuning serves every token count; ``answer_from`` answers an autotuner from recorded
choices (tables.py). On another FLA both are skipped with one logged line; tests/gpu/test_fla_internals.py fails when
what is used here changes. No torch, no Triton at module import.
"""

# ``pin_token_count_autotune``: FLA keys the autotuning of ``l2norm_fwd_kernel`` and ``layer_norm_gated_fwd_kernel``
# on ``NB = cdiv(rows, NB_ROWS)``, a bucket the kernels never read but the tuner times again (its cost:
# docs/PERFORMANCE.md); dropped from their ``Autotuner.keys``. ``answer_from``: an autotuner's ``cache`` (Triton asks
# ``key in cache``, then ``cache[key]``) answered from recorded choices. Any config computes the same normalisation
# of each row, the same states. On an FLA other than ``WRITTEN_FOR`` FLA autotunes as it ships.

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from importlib.metadata import PackageNotFoundError, version

log = logging.getLogger(__name__)


WRITTEN_FOR = "0.6."

"""The fla-core versions (a prefix) whose internals this module was read against."""


PIN_ENV = "HSEXTRACT_PIN_AUTOTUNE"


TOKEN_COUNT_KEY = "NB"


NB_ROWS = 2048 * 32

"""FLA's ``NB = triton.cdiv(T, 2048 * 32)`` for ``T`` rows of head dim <= 512 (fla/modules/norm/l2norm.py,
fused_norm_gate.py in 0.6)."""


PINNED_MODULES = ("fla.modules.l2norm", "fla.modules.fused_norm_gate")

"""Where FLA 0.6 keeps the ``NB``-keyed norm kernels (aliases of ``fla.modules.norm.*`` it keeps importable)."""


_skip_logged = False


def package_version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def fla_version() -> str | None:
    return package_version("fla-core")


def fla_available() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def patch_supported(installed: str | None = None) -> bool:
    """True unless an FLA other than ``WRITTEN_FOR`` is installed (then logged, once per process)."""
    global _skip_logged
    installed = fla_version() if installed is None else installed
    if installed is None or installed.startswith(WRITTEN_FOR):
        return True
    if not _skip_logged:
        log.warning(
            "flash-linear-attention %s is not the %sx hsextract's kernel warm-up was written for: autotune keys and "
            "recorded choices left as FLA makes them (start-up is slower, results are the same)",
            installed,
            WRITTEN_FOR,
        )
        _skip_logged = True
    return False


def pin_enabled(env=None) -> bool:
    return (os.environ if env is None else env).get(PIN_ENV, "1") != "0"


def pin_token_count_autotune(modules=PINNED_MODULES) -> list[str]:
    """Drop ``NB`` from the autotune key of every autotuned kernel of ``modules``; the names changed. Nothing
    when disabled (``HSEXTRACT_PIN_AUTOTUNE=0``), when FLA is absent or another version, or when Triton's
    autotuner keeps its key elsewhere than ``keys``."""
    if not pin_enabled() or not patch_supported():
        return []
    pinned = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # absent (CPU), or failing to import: the forward meets the same and says so
            continue
        for name, obj in sorted(vars(module).items()):
            tuner = autotuner_of(obj)
            keys = getattr(tuner, "keys", None)
            if isinstance(keys, list) and TOKEN_COUNT_KEY in keys:
                tuner.keys = [k for k in keys if k != TOKEN_COUNT_KEY]
                pinned.append(name)
    if pinned:
        log.info("autotune keys without the token count: %s", ", ".join(pinned))
    return pinned


def autotuner_of(obj, depth: int = 4):
    """The Triton ``Autotuner`` that ``obj`` is or wraps (``triton.heuristics`` on top keeps it in ``.fn``), also a
    subclass of it (fla 0.6's ``l2norm_fwd_kernel`` is a ``CachedAutotuner``)."""
    for _ in range(depth):
        if obj is None or any(c.__name__ == "Autotuner" for c in type(obj).__mro__):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def jit_of(tuner):
    """The ``@triton.jit`` function under the autotuner (the object with the kernel's source)."""
    fn = tuner.fn
    for _ in range(4):
        if isinstance(getattr(fn, "src", None), str):
            return fn
        fn = getattr(fn, "fn", None)
    return None


def source_hash(tuner) -> str | None:
    jit = jit_of(tuner)
    return hashlib.sha1(jit.src.encode()).hexdigest()[:16] if jit is not None else None


def config_dict(config) -> dict:
    return {
        "kwargs": dict(config.kwargs),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "num_ctas": getattr(config, "num_ctas", 1),
        "maxnreg": getattr(config, "maxnreg", None),
    }


def chosen(tuner) -> list[tuple]:
    """``(key, config)`` of every choice the autotuner has made in this process."""
    return list(dict.items(tuner.cache))


class _AnsweredCache(dict):
    """An autotuner's cache that answers a missing key from recorded choices (Triton asks ``key in cache``, then
    reads ``cache[key]``); the config handed out is the tuner's own candidate, with its pre-hook."""

    def __init__(self, base: dict, lookup, candidates):
        super().__init__(base)
        self.lookup = lookup
        self.candidates = candidates

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        wanted = self.lookup(key)
        config = next((c for c in self.candidates if config_dict(c) == wanted), None) if wanted else None
        if config is None:
            return False
        self[key] = config
        return True


def answer_from(tuner, lookup) -> None:
    """Make ``tuner`` take the config ``lookup(key)`` names (a ``config_dict``, or None to time as usual)."""
    tuner.cache = _AnsweredCache(dict(tuner.cache), lookup, list(tuner.configs))


def is_answered(tuner) -> bool:
    return isinstance(tuner.cache, _AnsweredCache)


def l2norm_fwd():
    """FLA's q/k l2 norm entry point, which the forward calls (the warm-up runs it alone per token bucket)."""
    from fla.modules.l2norm import l2norm_fwd

    return l2norm_fwd
