"""The run configuration: one dataclass that the CLI is built from and that YAML files in ``configs/`` load into.

Every default, every option's vocabulary and every option's help text lives here and nowhere else: the docstring
under a field is its ``--help`` text, and ``metadata`` says which commands take it (``job``: run and dry-run;
``run``: run only; none: YAML and code only), as torchtitan builds its CLI from its config dataclasses. The launcher writes the resolved config to ``<run_dir>/config.json``;
workers read it back from there, so a worker process never re-parses command-line options.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hsextract.errors import HsextractError, redact
from hsextract.hub import checkpoint_dtype, is_hub_id
from hsextract.layers import implies_final_state
from hsextract.prepare.report import TOO_LONG_POLICIES, bad_rows_limit
from hsextract.prepare.served import ROWS
from hsextract.prepare.template_args import template_kwargs_json
from hsextract.storage.fileio import load_json, write_json
from hsextract.validation import parse

DEFAULT_STAGING_ROOT = "/dev/shm/hsextract"


ENDPOINT_ENV = "HSEXTRACT_S3_ENDPOINT_URL"


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPES = tuple(DTYPE_BYTES)
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
STORAGE_DTYPES = ("float8_e4m3fn",)
DEVICES = ("auto", "cuda", "cpu")
KERNEL_MODES = ("fused", "stock")
COMPUTE_MODES = ("auto", "fp8", "bf16")
DEFAULT_STALL_TIMEOUT_S = 180.0
DEFAULT_PREPARE_WAIT_S = 3600.0
REQUIRED = ("model", "data", "output")
"""Fields without a default: given on the command line or in the --config file."""


def _opt(default, cli: str | None = "job", *, flag: str | None = None, choices: tuple | None = None):
    """A field with a default; ``cli`` names the commands that take it, ``flag`` overrides ``--field-name``."""
    return field(default=default, metadata={"cli": cli, "flag": flag, "choices": choices})


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    model: str = _opt(None)
    """Local checkpoint directory or Hub id (``org/name``) of the target model (any transformers causal LM). A Hub
    id is taken from the Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``; only there with ``HF_HUB_OFFLINE=1``),
    else downloaded before anything else runs."""

    revision: str | None = _opt(None)
    """With a Hub id: the branch, tag or commit to use (default: the cached snapshot of ``main``). The run
    records the snapshot's commit; a resume on another snapshot is refused."""

    tokenizer: str | None = _opt(None)
    """The tokenizer rows are rendered and tokenized with, instead of the model's own, as vLLM's and SGLang's
    ``--tokenizer``: a local directory or a Hub id, found as ``model`` is. Its name and files are part of the plan:
    a resume with another is refused."""

    tokenizer_revision: str | None = _opt(None)
    """With a Hub id for ``tokenizer``: the branch, tag or commit to use, as ``revision`` for the model."""

    trust_remote_code: bool = _opt(False)
    """Let transformers run code that the model's repository ships (its config, tokenizer or model class)."""

    chat_template: str | None = _opt(None)
    """A Jinja chat template file used instead of the tokenizer's own, as vLLM's and SGLang's ``--chat-template``:
    give the template your server renders with."""

    chat_template_kwargs: str | None = _opt(None)
    """Template arguments as a JSON object, as a server's ``chat_template_kwargs``, e.g.
    ``'{"enable_thinking": false}'``: they go to every rendering, including those that locate assistant turns for
    the loss mask. A YAML mapping works too."""

    rows: str = _opt(ROWS[0], choices=ROWS)
    """``per-turn``: one row per assistant turn (id ``<id>#t<k>``), the conversation up to it as the server rendered
    it then (earlier reasoning dropped where the template drops it), the loss on that turn alone."""

    data: tuple[str | dict, ...] | str = _opt(None)
    """Data sources, mixed in order (docs/DATA.md): files (``.jsonl[.gz|.zst]``, ``.json``, ``.parquet``),
    globs, directories, ``datasets`` directories (saved or Hub layout), ``hf:org/name``, ``s3://bucket/prefix``;
    options as a query string (``path?limit=500&name=chat``) or, in YAML, a mapping with ``path``. One string is
    one source, as is a one-entry list."""

    seed: int = _opt(0)
    """Draws the rows of sources given ``fraction`` or ``sample``."""

    dedupe: bool = _opt(False)
    """Keep once the rows whose token ids are identical, across all sources; the rest are counted per source."""

    max_samples: int | None = _opt(None)
    """Read only the first N rows of the mix (after each source's own ``limit``/``fraction``), for a quick trial of
    the whole job; part of the plan. Default: every row."""

    output: str = _opt(None, "run")
    """Local directory or ``s3://bucket/prefix`` that receives the batch files."""

    run_dir: str = _opt(None, "run")
    """Local directory for the plan, token cache, logs and progress files; reruns resume from it. Default:
    ``runs/<output name>-<hash of the output>`` under the current directory."""

    layers: tuple[int, ...] | str = _opt("dflash")
    """0-based ids of decoder layers whose OUTPUT is captured (= HF ``output_hidden_states[k + 1]``), or presets:
    ``dflash`` (5 evenly spaced, 1..N-3), ``dflash2`` ([5, 19, 33, 47, 61] for 64 layers),
    ``dspark`` (dflash's and the final state) or ``eagle3`` (1, N//2-1, N-4 and the final state); a union such as
    ``dflash,dflash2,eagle3`` captures every id they need once, in one forward."""

    max_length: int = _opt(4096)
    """Samples longer than this many tokens are truncated or skipped (``too_long``)."""

    too_long: str = _opt("truncate", choices=TOO_LONG_POLICIES)
    """``truncate`` keeps the first ``max_length`` tokens, ``skip`` drops the sample. Both are counted."""

    max_bad_rows: int | float | None = _opt(None)
    """Stop before any weight loads when more rows than this are malformed or empty: a count (``100``) or a
    fraction of the rows read (``0.01``). Default: no limit; bad rows are skipped, counted and the first shown."""

    max_tokens_per_batch: int = _opt(65536)
    """Bound on rows x longest row of a batch (padded tokens)."""

    max_rows: int = _opt(512)
    """Bound on rows per batch: flash-linear-attention's launch grid breaks at a few thousand rows."""

    shards: int = _opt(1, "run")
    """Worker processes on this node, one per GPU. The plan has ``nodes x shards`` shards."""

    nodes: int = _opt(1, "run")
    """Nodes running this job; default from the scheduler's environment (SLURM, else ``NNODES``/``NODE_RANK``),
    else 1."""

    node_rank: int = _opt(0, "run")
    """This node: it runs shards ``node_rank * shards`` .. ``node_rank * shards + shards - 1``."""

    prepare_wait_s: float = _opt(DEFAULT_PREPARE_WAIT_S, "run", flag="--prepare-wait")
    """Multi-node jobs: seconds a node other than node 0 waits for node 0 to publish the tokenized data and the plan
    in the output (it takes them instead of tokenizing everything itself) before it gives up with an error; it says
    every 30 s what it waits for. A node 0 that dies while preparing is noticed sooner, by its lease going stale."""

    gpus: tuple[int, ...] | None = _opt(None, "run")
    """GPU indices for the shards (default 0..shards-1)."""

    device: str = _opt("auto", choices=DEVICES)
    """``auto``: ``cuda`` where a CUDA build of torch finds an NVIDIA GPU, else ``cpu`` (the run says which);
    ``cuda``: one GPU per shard, checked before the data is prepared; ``cpu``: small models (tests, the demo)."""

    dtype: str = _opt("bfloat16", choices=(*DTYPES, *DTYPE_ALIASES, "auto"))
    """The dtype the model runs and states are stored in (unless ``storage_dtype`` says otherwise); ``bf16``,
    ``fp16``, ``fp32`` are the same; ``auto`` is the checkpoint's own (its config's ``dtype``), else bfloat16."""

    attn_implementation: str = _opt("sdpa")
    """transformers' attention implementation for the full-attention layers (``sdpa``, ``eager``...)."""

    kernels: str | None = _opt(None, choices=KERNEL_MODES)
    """``fused`` (the default on CUDA: hsextract's fused norms, convolution, gates and grouped-head linear attention
    for qwen3_5 models; closer to a float32 forward than stock, measured) or ``stock`` (transformers' own forward;
    the default on CPU)."""

    compute: str = _opt("auto", choices=COMPUTE_MODES)
    """The linears' numerics. ``auto``: the checkpoint's own (an FP8-served checkpoint, ``quantization_config``
    fp8 in 128x128 blocks as Qwen3.x-FP8's, computes in fp8 as vLLM and SGLang serve it; a bf16 one in ``dtype``).
    ``fp8``: a bf16 checkpoint too, quantized on load by the same recipe (scale = amax / 448 per 128x128 weight tile;
    activations per token per 128 columns at run time). ``bf16``: an FP8 checkpoint dequantized on load. fp8 runs
    block-scaled GEMMs on Hopper GPUs and is emulated in float32 on the CPU."""

    final_state: bool = _opt(False)
    """Also store the final hidden state: the last decoder layer's output before the final norm for every token
    (the forward then runs to the last layer), and the norm's weight and epsilon once per output. EAGLE-3
    trainers, DSpark, and DFlash in speculators and ModelOpt, need it; the ``eagle3`` and ``dspark`` presets imply it."""

    target_topk: int | None = _opt(None)
    """Also store, for every token, the target's K most likely next tokens: ids (int32) and log-probabilities
    (float32, log-softmax over the full vocabulary), from ``lm_head`` applied to the final normed state on the GPU
    in chunks of tokens. The forward then runs to the last layer; K * 8 bytes per token. Off by default."""

    storage_dtype: str | None = _opt(None, choices=STORAGE_DTYPES)
    """How states are stored: the run ``dtype`` (default), or ``float8_e4m3fn`` with a float32 scale per token
    per layer (absmax / 448), quantized on the device: about half the bytes of bfloat16."""

    staging: str | None = _opt(None, "run")
    """Root of the staging directories (default ``/dev/shm/hsextract``). Each run stages in its own directory
    under it, named after the run dir and a hash of its absolute path, so two runs never share staged files."""

    staging_max_gb: float = _opt(16.0, "run")
    """Staged bytes per shard at which its worker waits for the uploader to drain."""

    s3_endpoint_url: str | None = _opt(None, "run")
    """For S3-compatible stores; ``AWS_ENDPOINT_URL_S3`` is honoured too."""

    num_proc: int | None = _opt(None)
    """Processes that tokenize the dataset; None chooses from the cores and the data's size: 1 below 16 MB or 4
    cores (starting a pool costs more than it saves there), else one per core, up to 16."""

    pinned_buffers: int = _opt(3, "run")
    """Host buffers per worker that device-to-host copies land in; bounds host memory and how far the GPU runs
    ahead of the writer."""

    stall_timeout_s: float = _opt(DEFAULT_STALL_TIMEOUT_S, "run", flag="--stall-timeout")
    """Seconds without a heartbeat (worker or uploader) or without a finished batch after which a shard counts as
    stalled: its worker logs it, the launcher prints it naming the process, ``status`` shows it. Nothing is
    stopped; a stall that ends is reported as recovered."""

    check_states: bool = _opt(True, "run")
    """Stop the run at the first batch whose states hold a NaN or Inf, or a token whose state is all zeros, in
    any stored layer, naming the batch and the layer (a float16 overflow, broken weights). The check runs on the
    device and costs two reductions per batch. Off only for a model known to produce such states."""

    prewarm: bool = _opt(True, "run")
    """On GPUs with flash-linear-attention: compile its kernels once into the kernel cache while the shards load
    their weights (the shards wait for it before their first batch), instead of every shard compiling them at
    once; skipped when the kernel cache already holds every kernel the plan needs."""

    kernel_cache: str | None = _opt(None, "run")
    """Root of the kernel cache shared by every job of this user on the machine (Triton's compiled kernels and
    autotune results, in a subdirectory per GPU and software setup). Default ``$HSEXTRACT_KERNEL_CACHE``, else an
    already set ``TRITON_CACHE_DIR`` (used as it is), else ``$XDG_CACHE_HOME/hsextract/triton``."""

    random_weights: bool = _opt(False, None)
    """Benchmarks only: build the architecture from ``model`` (a config) with random weights. ``run`` refuses it."""

    model_dir: str | None = _opt(None, None)
    """Set by ``with_model_resolved``: the local directory every process reads (a Hub id's snapshot)."""

    model_commit: str | None = _opt(None, None)
    """Set by ``with_model_resolved``: the Hub commit of its snapshot (None for a local directory)."""

    tokenizer_dir: str | None = _opt(None, None)
    """Set by ``with_model_resolved``: the local directory ``tokenizer`` names (a Hub id's snapshot)."""

    tokenizer_commit: str | None = _opt(None, None)
    """Set by ``with_model_resolved``: the Hub commit of the tokenizer's snapshot (None for a local directory)."""

    def __post_init__(self):
        from hsextract.prepare.source_spec import parse_sources  # a leaf: parsing only, nothing is read

        missing = [name for name in REQUIRED if not getattr(self, name)]
        if missing:
            raise HsextractError(
                "missing "
                + ", ".join("--" + m for m in missing)
                + " (hsextract run --help lists every option)"
            )
        if not self.run_dir:  # the CLI defaults it from --output; code that builds a config gives it
            raise HsextractError("missing --run-dir")
        if isinstance(self.data, Path):
            object.__setattr__(self, "data", str(self.data))
        elif isinstance(self.data, list):
            object.__setattr__(self, "data", tuple(self.data))
        parse_sources(self.data)  # a bad option fails here, before anything runs
        self._check_chat_options()
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)  # auto, for a Hub id: once it is resolved
        if dtype == "auto" and (self.model_dir or Path(self.model).is_dir() or not is_hub_id(self.model)):
            dtype = checkpoint_dtype(self.model_path, DTYPES)
        object.__setattr__(self, "dtype", dtype)
        if self.dtype not in (*DTYPES, "auto"):
            raise HsextractError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}, bf16 or auto")
        if self.too_long not in TOO_LONG_POLICIES:
            raise HsextractError(f"--too-long {self.too_long!r} is not one of {', '.join(TOO_LONG_POLICIES)}")
        object.__setattr__(self, "max_bad_rows", bad_rows_limit(self.max_bad_rows))
        k = self.target_topk
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise HsextractError(f"--target-topk must be a whole number of tokens, got {k!r}")
        for name in (
            "max_length",
            "max_tokens_per_batch",
            "max_rows",
            "shards",
            "nodes",
            "num_proc",
            "pinned_buffers",
            "target_topk",
            "max_samples",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise HsextractError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.max_length > self.max_tokens_per_batch:
            raise HsextractError(
                f"--max-length {self.max_length} exceeds --max-tokens-per-batch {self.max_tokens_per_batch}: "
                "a sample that long could never fit in a batch; lower --max-length or raise the batch budget"
            )
        if not 0 <= self.node_rank < self.nodes:
            raise HsextractError(f"node rank {self.node_rank} is not in 0..{self.nodes - 1}")
        if self.gpus is not None and len(self.gpus) < self.shards:
            raise HsextractError(f"--gpus lists {len(self.gpus)} GPUs for {self.shards} shards")
        if self.compute not in COMPUTE_MODES:
            raise HsextractError(f"--compute must be one of {', '.join(COMPUTE_MODES)}, got {self.compute!r}")
        if self.kernels not in (None, *KERNEL_MODES):
            raise HsextractError(f"--kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        if self.device not in DEVICES:
            raise HsextractError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "auto":  # resolved once, here: config.json and the workers see cuda or cpu
            from hsextract.devices import resolve_device

            object.__setattr__(self, "device", resolve_device("auto")[0])
        if not (math.isfinite(self.staging_max_gb) and self.staging_max_gb > 0):
            raise HsextractError(f"--staging-max-gb must be a positive number, got {self.staging_max_gb}")
        if not (math.isfinite(self.prepare_wait_s) and self.prepare_wait_s > 0):
            raise HsextractError(
                f"--prepare-wait must be a positive number of seconds, got {self.prepare_wait_s}"
            )
        if not (math.isfinite(self.stall_timeout_s) and self.stall_timeout_s > 0):
            raise HsextractError(
                f"--stall-timeout must be a positive number of seconds, got {self.stall_timeout_s}"
            )
        if self.storage_dtype is not None and self.storage_dtype not in STORAGE_DTYPES:
            raise HsextractError(
                f"--storage-dtype {self.storage_dtype!r} is not one of {', '.join(STORAGE_DTYPES)} "
                "(leave it out to store states in --dtype)"
            )

    def _check_chat_options(self) -> None:
        object.__setattr__(self, "chat_template_kwargs", template_kwargs_json(self.chat_template_kwargs))
        if self.chat_template is not None:
            self.chat_template_text  # noqa: B018 -- a missing file fails here
        if self.tokenizer_revision and not self.tokenizer:
            raise HsextractError(f"--tokenizer-revision {self.tokenizer_revision} pins --tokenizer: give one")
        if self.rows not in ROWS:
            raise HsextractError(f"--rows must be one of {', '.join(ROWS)}, got {self.rows!r}")

    def with_model_resolved(self) -> RunConfig:
        """This config with ``model`` resolved to the directory every process reads (a Hub id's snapshot in the
        Hugging Face cache, downloaded if missing): done once, by the command the user runs; config.json carries
        the result to the workers."""
        from hsextract.hub import resolve_model, resolve_tokenizer

        cfg = self
        if Path(self.model).expanduser().is_dir() or is_hub_id(self.model):  # else the model's checks say so
            resolved = resolve_model(self.model, self.revision)
            cfg = dataclasses.replace(cfg, model_dir=resolved.path, model_commit=resolved.commit)
        if self.tokenizer is not None:  # a tokenizer not found fails here, before the model's config is read
            tok = resolve_tokenizer(self.tokenizer, self.tokenizer_revision)
            cfg = dataclasses.replace(cfg, tokenizer_dir=tok.path, tokenizer_commit=tok.commit)
        return cfg

    @property
    def model_path(self) -> str:
        """Where the model's files are: the resolved directory, else ``model`` as given (a local directory)."""
        return self.model_dir or self.model

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer's files are: ``tokenizer``'s directory when one is given, else the model's."""
        return self.tokenizer_dir or self.tokenizer or self.model_path

    @property
    def chat_options(self):
        """The template and arguments the run renders conversations with (``prepare.chat.ChatOptions``)."""
        from hsextract.prepare.chat import ChatOptions

        given = self.chat_template
        name = None if given is None else "the --chat-template text"
        if given is not None and Path(given).expanduser().is_file():
            name = f"the chat template {given}"
        return ChatOptions.of(self.chat_template_text, self.template_kwargs, self.rows, name)

    @property
    def template_kwargs(self) -> dict:
        """``chat_template_kwargs`` as a dict (empty when not given)."""
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    @property
    def chat_template_text(self) -> str | None:
        """The template ``chat_template`` names (a file, or the template itself as vLLM also takes it)."""
        given = self.chat_template
        if given is None:
            return None
        path = Path(given).expanduser()
        if path.is_file():
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise HsextractError(f"--chat-template {given}: cannot read it ({e})") from None
        if "{{" in given or "{%" in given:
            return given
        raise HsextractError(
            f"--chat-template {given}: no such file. It takes a Jinja template file (or its text) as vLLM's "
            "does, not a template name as SpecForge's: leave it out for the tokenizer's own template, or give "
            "the file your server renders with"
        )

    @property
    def wants_final_state(self) -> bool:
        """``final_state``, or implied by a preset whose trainers read it (``eagle3``, ``dspark``)."""
        return self.final_state or implies_final_state(self.layers)

    @property
    def kernel_mode(self) -> str:
        return self.kernels or ("fused" if self.device == "cuda" else "stock")

    @property
    def share_prefixes(self) -> bool:
        """Per-turn rows on the stock forward: a conversation's rows share one batch and each shared prefix is
        computed once (model/prefix.py). The fused kernels keep no cache: their rows are computed whole."""
        return self.rows == "per-turn" and self.kernel_mode == "stock"

    @property
    def total_shards(self) -> int:
        return self.nodes * self.shards

    @property
    def local_shards(self) -> list[int]:
        """The plan's shards this node runs."""
        return node_shards(self.total_shards, self.nodes, self.node_rank)

    @property
    def staging_dir(self) -> Path:
        """This run's staging directory."""
        return run_staging_dir(self.staging, self.run_dir)

    def to_json(self) -> dict:
        """What config.json holds: every field, the endpoint's credentials redacted. The workers get the endpoint
        as given through ``ENDPOINT_ENV`` (``load``), so no credential is ever written to disk."""
        d = dataclasses.asdict(self)
        if self.s3_endpoint_url:
            d["s3_endpoint_url"] = redact(self.s3_endpoint_url)
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "the run's configuration") -> RunConfig:
        return parse(cls, d, lambda problems: HsextractError(f"{where} is damaged ({problems})"))

    def save(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        cfg = cls.from_json(load_json(path, "the run's configuration"), where=str(path))
        given = os.environ.get(ENDPOINT_ENV)
        if given and cfg.s3_endpoint_url == redact(given):
            cfg = dataclasses.replace(cfg, s3_endpoint_url=given)
        return cfg

    def child_env(self) -> dict[str, str]:
        """Environment a worker needs beyond config.json: the endpoint with its credentials, if it has any."""
        url = self.s3_endpoint_url
        return {ENDPOINT_ENV: url} if url and redact(url) != url else {}


@functools.cache
def field_docs(cls: type | None = None) -> dict[str, str]:
    """Each field's docstring (the string literal under it) of RunConfig or another config class, from its source."""
    body = ast.parse(inspect.getsource(cls or RunConfig)).body[0].body
    docs = {}
    for node, doc in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def node_shards(total_shards: int, nodes: int, rank: int) -> list[int]:
    """The plan's shards node ``rank`` of ``nodes`` runs: a contiguous block of ``total_shards // nodes``
    (every node runs the same ``--shards``). The one place that maps nodes to shards."""
    per_node = total_shards // max(nodes, 1)
    return list(range(rank * per_node, (rank + 1) * per_node))


def run_staging_dir(staging_root: str | None, run_dir: str | os.PathLike) -> Path:
    """``<root>/<run dir name>-<hash of its absolute path>``: unique per run dir, the same on every rerun."""
    resolved = Path(run_dir).resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    return Path(staging_root or DEFAULT_STAGING_ROOT) / f"{resolved.name}-{digest}"


def load_yaml(path: str | Path, cls: type | None = None) -> dict:
    """Options from a YAML file in ``configs/``; keys are the field names of RunConfig or ``cls`` (``-`` or ``_``)."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise HsextractError(f"config file {path} does not exist") from None
    if not isinstance(raw, dict):
        raise HsextractError(f"config file {path} must hold a mapping of option: value")
    known = {f.name for f in dataclasses.fields(cls or RunConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise HsextractError(f"config file {path}: unknown option {key!r}")
        out[name] = tuple(value) if isinstance(value, list) else value
    return out
