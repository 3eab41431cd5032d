"""Workers started while the launcher prepares, so that their imports and CUDA start-up overlap the preparation.

An early worker is an ordinary worker process whose first call, ``arrive``, finds a go file named in its
environment: it starts CUDA, pins its host buffers (hostmem.py) and imports the model's code, then waits for the
go (begin.py writes it once the plan is accepted) and runs on as if started then, or exits. No weight is read
before the go, so bad data still fails before the load with the same message.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from hsextract.config import RunConfig

log = logging.getLogger(__name__)


PRESTART_ENV = "HSEXTRACT_PRESTART"

"""``0`` turns early workers off, ``1`` on (also on CPU: the tests run the mechanism there); on CUDA by default."""


GO_FILE_ENV = "HSEXTRACT_PRESTART_GO"


MODEL_ENV = "HSEXTRACT_PRESTART_MODEL"


PIN_ENV = "HSEXTRACT_PRESTART_PIN"

"""What sizes the pipeline's host buffers (``pin_spec``): the early process pins them while it imports."""


POLL_S = 0.05


def prestart_enabled(cfg: RunConfig, env=None) -> bool:
    """On CUDA unless ``HSEXTRACT_PRESTART=0``; ``=1`` also on CPU."""
    value = (os.environ if env is None else env).get(PRESTART_ENV, "")
    return value == "1" or (cfg.device == "cuda" and value != "0")


def early_env(cfg: RunConfig, go: Path) -> dict[str, str]:
    """What makes a worker process an early one: its go file, the model to import, on CUDA what to pin."""
    env = {GO_FILE_ENV: str(go), MODEL_ENV: str(cfg.model_path)}
    if cfg.device == "cuda":
        env[PIN_ENV] = json.dumps(pin_spec(cfg))
    return env


def pin_spec(cfg: RunConfig) -> dict:
    """What the host buffers' size depends on, from the config alone (the model's config is read in the child)."""
    return {
        "count": cfg.pinned_buffers,
        "max_tokens": cfg.max_tokens_per_batch,
        "layers": cfg.layers if isinstance(cfg.layers, str) else list(cfg.layers),
        "final_state": cfg.wants_final_state,
        "storage_dtype": cfg.storage_dtype,
        "dtype": cfg.dtype,
    }


def slot_bytes(spec: dict, model: str) -> int:
    """The bytes of one of the pipeline's host buffers for the largest batch the config allows (run/pipeline.py
    sizes them for the plan's largest, which is at most this)."""
    from hsextract.config import DTYPE_BYTES
    from hsextract.layers import resolve_layer_ids
    from hsextract.model.load import load_model_config
    from hsextract.output import StateLayout

    _, text, num_layers = load_model_config(model)
    layers = spec["layers"] if isinstance(spec["layers"], str) else tuple(spec["layers"])
    layout = StateLayout(
        resolve_layer_ids(layers, num_layers), num_layers, spec["final_state"], spec["storage_dtype"]
    )
    itemsize = 1 if layout.storage_dtype else DTYPE_BYTES[spec["dtype"]]
    return spec["max_tokens"] * len(layout.slot_layers) * text.hidden_size * itemsize


def _pin_ahead(spec: dict, model: str) -> None:
    """CUDA started, then the host buffers pinned in a thread while the rest is imported."""
    import torch

    from hsextract.startup.hostmem import reserve

    torch.cuda.init()
    torch.empty(1, device="cuda")
    try:
        nbytes = slot_bytes(spec, model)
    except Exception as e:  # a bad model or layer ids: the launcher's checks say so
        log.warning("no host buffers pinned ahead: %r", e)
        return
    reserve(spec["count"], nbytes)


def _warm_imports(model: str, pin: dict | None = None, program: str | None = None) -> None:
    """What the worker would import in its model load, the model's class included, and the module ``program``
    (the worker's own). With ``pin`` (``pin_spec``), CUDA starts first and the host buffers are pinned in a thread
    beside the other imports."""
    import importlib

    import torch

    if pin and torch.cuda.is_available():
        _pin_ahead(pin, model)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    import hsextract.model.load  # noqa: F401
    import hsextract.model.qwen3_5  # noqa: F401  (the fused kernels, Triton)

    if program:
        importlib.import_module(program)

    try:
        _get_model_class(AutoConfig.from_pretrained(model), AutoModelForCausalLM._model_mapping)
    except Exception as e:  # the worker meets it again and says so
        log.warning("could not import the model's class early: %r", e)
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context, made now rather than in the load


def wait_for_go(go: Path, poll_s: float = POLL_S) -> dict:
    while True:
        try:
            return json.loads(go.read_text())
        except (OSError, ValueError):
            time.sleep(poll_s)


def arrive(env=None, program: str | None = None) -> bool:
    """First thing in a worker process, before its own imports. An early one (a go file in its environment) starts
    CUDA, pins its host buffers and imports (``program``: the worker's module too), waits for its go and takes the
    go's environment; returns False if told not to run. Any other: True at once."""
    env = os.environ if env is None else env
    go_file = env.get(GO_FILE_ENV)
    if not go_file:
        return True
    t0 = _process_started_at()
    pin = env.get(PIN_ENV)
    _warm_imports(env[MODEL_ENV], json.loads(pin) if pin else None, program)
    t_ready = time.time()
    go = wait_for_go(Path(go_file))
    if not go.get("run"):
        return False
    env.update(go.get("env", {}))
    print(  # into the shard's stderr log: the worker's own log starts after this
        f"started early: imports and CUDA in {t_ready - t0:.1f} s, then {time.time() - t_ready:.1f} s waiting "
        f"for the plan (started at {t0:.3f})",
        flush=True,
    )
    return True


def _process_started_at() -> float:
    """When this process started (the clock's time): the imports before ``arrive`` are the early work too. Now
    where /proc does not say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - since_boot)
