"""Workers started while the launcher prepares: their imports and CUDA start-up overlap the data's preparation.

A GPU worker spends ~20 s importing torch, transformers and flash-linear-attention before it reads a weight, and the
launcher ~12 s preparing the data: one after the other they were a third of a warm start. So on CUDA, once the places
are checked, the launcher starts one process per local shard that starts CUDA, pins its host buffers (hostmem.py)
and imports the model's code, then waits for its go file: ``{"run": true, "env": {...}}`` once the plan is accepted
(it then becomes the worker, as if started then), or ``{"run": false}``. No weight is read before the go, so bad data
still fails before the load with the same message. ``HSEXTRACT_PRESTART=0`` or ``=1`` overrides (off on CPU).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from hsextract.config import RunConfig
from hsextract.run.procs import wait_or_kill
from hsextract.run.rundir import RunDir
from hsextract.storage.fileio import atomic_write

log = logging.getLogger(__name__)


PRESTART_ENV = "HSEXTRACT_PRESTART"


GO_FILE_ENV = "HSEXTRACT_PRESTART_GO"


MODEL_ENV = "HSEXTRACT_PRESTART_MODEL"


PIN_ENV = "HSEXTRACT_PRESTART_PIN"

"""What sizes the pipeline's host buffers (``pin_spec``): the early process pins them while it imports
(startup/hostmem.py)."""


ENTRY = "from hsextract.run.procs import exit_now; from hsextract.run.prestart import main; exit_now(main())"

"""A ``-c`` program, as the worker's own entry (launcher.py says why)."""


POLL_S = 0.05


def prestart_enabled(cfg: RunConfig, env=None) -> bool:
    """On CUDA unless ``HSEXTRACT_PRESTART=0``; ``=1`` also on CPU (the tests run the mechanism there)."""
    value = (os.environ if env is None else env).get(PRESTART_ENV, "")
    return value == "1" or (cfg.device == "cuda" and value != "0")


class Prestarted:
    """The launcher's side: the processes started early, handed to ``launch`` shard by shard."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = RunDir(cfg.run_dir)
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self) -> None:
        """Start one process per local shard (CUDA only); called once the places are checked
        (``run.preflight.check_places_and_files``), before the model's config is read."""
        from hsextract.run.launcher import open_run_kernel_cache, start_worker

        if not prestart_enabled(self.cfg):
            return
        kernel_dir = open_run_kernel_cache(self.cfg).dir
        for shard in self.cfg.local_shards:
            go = self.run_dir.prestart_file(shard)
            go.parent.mkdir(parents=True, exist_ok=True)
            go.unlink(missing_ok=True)
            extra = {GO_FILE_ENV: str(go), MODEL_ENV: str(self.cfg.model_path)}
            if self.cfg.device == "cuda":
                extra[PIN_ENV] = json.dumps(pin_spec(self.cfg))
            self.procs[shard] = start_worker(self.cfg, shard, kernel_dir, extra, entry=ENTRY)
        log.info("started %d worker(s) early, while the data is prepared", len(self.procs))

    def take(self, shard: int, env: dict[str, str]) -> subprocess.Popen | None:
        """The shard's started process, told to run as its worker with ``env`` added; None if none was started
        (or it has died: the launcher then starts a worker the usual way)."""
        proc = self.procs.pop(shard, None)
        if proc is None:
            return None
        if proc.poll() is not None:
            log.warning("the early worker of shard %d exited (%s); starting it again", shard, proc.returncode)
            return None
        atomic_write(self.run_dir.prestart_file(shard), json.dumps({"run": True, "env": env}).encode())
        return proc

    def release(self, timeout: float = 10.0) -> None:
        """Tell every process not taken to exit, and wait for them (killed if they do not)."""
        procs, self.procs = self.procs, {}
        for shard in procs:
            try:
                atomic_write(self.run_dir.prestart_file(shard), json.dumps({"run": False}).encode())
            except OSError:
                pass
        wait_or_kill(procs.values(), timeout)

    def __enter__(self) -> Prestarted:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


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


def _warm_imports(model: str, pin: dict | None = None) -> None:
    """What the worker would import at its start and in its model load, the model's class included. With ``pin``
    (``pin_spec``), CUDA starts first and the host buffers are pinned in a thread beside the other imports."""
    import torch

    if pin and torch.cuda.is_available():
        _pin_ahead(pin, model)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    import hsextract.model.qwen3_5  # noqa: F401  (the fused kernels, Triton)
    import hsextract.run.worker  # noqa: F401

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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    t0 = time.time()
    pin = os.environ.get(PIN_ENV)
    _warm_imports(os.environ[MODEL_ENV], json.loads(pin) if pin else None)
    t_ready = time.time()
    go = wait_for_go(Path(os.environ[GO_FILE_ENV]))
    if not go.get("run"):
        return 0
    os.environ.update(go.get("env", {}))
    from hsextract.run.worker import main as worker_main

    print(  # into the shard's stderr log: the worker's own log starts in worker_main
        f"started early: imports and CUDA in {t_ready - t0:.1f} s, then {time.time() - t_ready:.1f} s waiting "
        f"for the plan (started at {t0:.3f})",
        flush=True,
    )
    return worker_main(argv)
