"""The options of ``hsextract regenerate``: one dataclass the CLI is built from and a YAML file loads into.

As with ``RunConfig``, the docstring under a field is its ``--help`` text and YAML keys are the field names. What
the servers are asked (``request_options``) and what shapes the rows (``settings``) are recorded in the output;
a rerun whose settings differ is refused. Endpoints, concurrency, timeouts and chunking may change between runs:
they decide how the rows are fetched, not what they are.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from hsextract.errors import HsextractError, hide, redact
from hsextract.prepare.template_args import template_kwargs_json

TURNS = ("all", "first")
COMPRESSIONS = ("zstd", "gzip")
ROUTES = ("/chat/completions", "/completions", "/models")
"""The routes of an OpenAI-compatible server under its base URL: an --endpoint ending in one is cut to its base."""
REQUIRED = ("endpoint", "served_model", "data", "output")
"""Fields without a default: given on the command line or in the --config file."""


def _opt(default, *, flag: str | None = None, choices: tuple | None = None):
    return field(default=default, metadata={"cli": "regenerate", "flag": flag, "choices": choices})


@dataclass(kw_only=True, frozen=True)
class RegenerateConfig:
    endpoint: tuple[str, ...] | str = _opt(None)
    """Base URL of an OpenAI-compatible server, e.g. ``http://gpu-node:8000/v1`` (``/v1`` is added to a URL without
    a path; a full ``.../v1/chat/completions`` is taken as its base); give it several times to spread the
    requests over several servers."""

    served_model: str = _opt(None)
    """The model name the servers serve (vLLM's and SGLang's ``--served-model-name``, else the model they were
    started with), sent as the requests' ``model``; checked against each server's ``/v1/models``."""

    data: tuple[str | dict, ...] | str = _opt(None)
    """Data sources, as ``hsextract run`` takes them (docs/DATA.md): files, globs, directories, ``hf:org/name``,
    ``s3://bucket/prefix``, several for a mix, options as ``path?limit=500&name=chat``. Rows keep the ids ``run``
    gives them."""

    output: str = _opt(None)
    """Directory or ``s3://bucket/prefix`` for the replies: compressed JSONL chunks and ``regenerate.json``.
    ``hsextract run --data`` takes it as it is; rerun the same command to resume."""

    api_key_env: str | None = _opt(None)
    """Name of the environment variable that holds the servers' API key (sent as ``Authorization: Bearer``). The
    key is never an option's value and is never written or printed."""

    max_tokens: int | None = _opt(None)
    """The most tokens one reply may have (``max_tokens``); a reply cut there has ``finish_reason`` ``length``."""

    temperature: float | None = _opt(None)
    """Sampling temperature sent to the servers (their default when not given)."""

    top_p: float | None = _opt(None)
    """Nucleus sampling ``top_p`` sent to the servers."""

    top_k: int | None = _opt(None)
    """``top_k`` sent to the servers (vLLM and SGLang take it; OpenAI's API does not)."""

    seed: int | None = _opt(None)
    """The sampling ``seed`` sent with every request (the draw of ``fraction`` rows is ``--data-seed``)."""

    chat_template_kwargs: str | None = _opt(None)
    """Template arguments as a JSON object, sent as the requests' ``chat_template_kwargs`` (vLLM, SGLang), e.g.
    ``'{"enable_thinking": true}'``; give ``hsextract run`` the same. A YAML mapping works too."""

    max_samples: int | None = _opt(None)
    """Request only the first N rows of the mix (after each source's own ``limit``/``fraction``), for a quick trial;
    a rerun with a larger N (or none) requests the rest. Default: every row."""

    turns: str = _opt("all", choices=TURNS)
    """``all``: every assistant turn regenerated in order, each request holding the regenerated turns before it;
    ``first``: the first exchange only. A conversation is regenerated up to its first tool result or tool call."""

    drop_truncated: bool = _opt(False)
    """Leave out rows with a reply cut at ``max_tokens`` (they are kept and counted by default)."""

    dedupe: bool = _opt(False)
    """Request once the rows whose prompts (system, user and tools) are identical, across all sources; the rest
    are counted as duplicates."""

    data_seed: int = _opt(0)
    """Draws the rows of sources given ``fraction`` or ``sample`` (``run``'s ``seed``)."""

    concurrency: int = _opt(64)
    """Requests in flight at once, over all endpoints (one process keeps thousands in flight)."""

    request_timeout_s: float = _opt(600.0, flag="--request-timeout")
    """Seconds one request may take, reply included, before it is retried."""

    max_retries: int = _opt(5)
    """Retries of a request that failed with 429, a 5xx, a timeout or a dropped connection (with backoff) before
    its row counts as failed; a failed row is not written and is requested again by the next run."""

    endpoint_down_s: float = _opt(60.0, flag="--endpoint-down-after")
    """Seconds of nothing but failures (connections refused or dropped, 5xx, timeouts) after which an endpoint is
    taken out of the rotation for the rest of the run; its rows go to the others."""

    chunk_rows: int = _opt(1000)
    """Rows per chunk file. A chunk is written whole or not at all: after a crash, a rerun requests again only
    the rows of no complete chunk."""

    chunk_interval_s: float = _opt(60.0, flag="--chunk-interval")
    """Seconds after which the finished rows are written as a chunk even if fewer than ``chunk_rows``."""

    compression: str = _opt("zstd", choices=COMPRESSIONS)
    """Chunk files are JSON lines (one row each) compressed as ``.jsonl.zst`` (with frame checksums) or
    ``.jsonl.gz``: ``zstd -dc chunk-000000.jsonl.zst | head`` (``zcat`` for gzip) shows them as text;
    ``hsextract run --data`` reads the directory as it is."""

    s3_endpoint_url: str | None = _opt(None)
    """For an S3-compatible ``s3://`` output or data source; ``AWS_ENDPOINT_URL_S3`` is honoured too."""

    def __post_init__(self):
        from hsextract.prepare.source_spec import parse_sources

        missing = [name for name in REQUIRED if not getattr(self, name)]
        if missing:
            raise HsextractError(
                "missing "
                + ", ".join("--" + m.replace("_", "-") for m in missing)
                + " (hsextract regenerate --help lists every option)"
            )
        endpoints = (self.endpoint,) if isinstance(self.endpoint, str) else tuple(self.endpoint)
        object.__setattr__(self, "endpoint", tuple(_endpoint_url(e) for e in endpoints))
        if len(set(self.endpoint)) != len(self.endpoint):
            raise HsextractError(f"--endpoint lists the same server twice: {', '.join(self.endpoint)}")
        if isinstance(self.data, Path):
            object.__setattr__(self, "data", str(self.data))
        elif isinstance(self.data, list):
            object.__setattr__(self, "data", tuple(self.data))
        _check_apart(self.output, parse_sources(self.data))
        object.__setattr__(self, "chat_template_kwargs", template_kwargs_json(self.chat_template_kwargs))
        if self.turns not in TURNS:
            raise HsextractError(f"--turns must be one of {', '.join(TURNS)}, got {self.turns!r}")
        if self.compression not in COMPRESSIONS:
            raise HsextractError(
                f"--compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}"
            )
        for name in ("max_tokens", "concurrency", "chunk_rows", "max_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise HsextractError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.max_retries < 0:
            raise HsextractError(f"--max-retries must be 0 or more, got {self.max_retries}")
        for name, flag in (
            ("request_timeout_s", "--request-timeout"),
            ("endpoint_down_s", "--endpoint-down-after"),
            ("chunk_interval_s", "--chunk-interval"),
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise HsextractError(f"{flag} must be a positive number of seconds, got {value}")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            hide(self.api_key_env)
            raise HsextractError(
                f"--api-key-env takes the NAME of an environment variable (e.g. OPENAI_API_KEY), not the key: "
                f"got a value of {len(self.api_key_env)} characters that is no variable name"
            )

    @classmethod
    def given(cls, config_file: str | None, options: dict) -> RegenerateConfig:
        """From a YAML file's keys (``--config``), overridden by the options given on the command line."""
        from hsextract.config import load_yaml

        values = load_yaml(config_file, cls) if config_file else {}
        values.update({k: v for k, v in options.items() if v is not None and v != ()})
        return cls(**values)

    def api_key(self) -> str | None:
        """The key from ``api_key_env``, hidden from every message from now on (errors.hide); a variable that is
        not set is an error naming it, unless the name looks like a key itself (then it is hidden too)."""
        name = self.api_key_env
        if name is None:
            return None
        key = os.environ.get(name)
        if not key and not _looks_like_a_name(name):
            hide(name)
            raise HsextractError(
                f"--api-key-env takes the NAME of an environment variable (e.g. OPENAI_API_KEY), not the key: no "
                f"variable of the name given is set, and that name ({len(name)} characters) is not shown as it "
                "may be the key itself"
            )
        if not key:
            raise HsextractError(
                f"--api-key-env {name}: the variable is not set (or empty) in this environment; export {name}=... first"
            )
        hide(key)
        bad = next((i for i, c in enumerate(key) if ord(c) < 32 or ord(c) == 127), None)
        if bad is not None:
            what = "a line break" if key[bad] in "\r\n" else "a control character"
            raise HsextractError(
                f"the key in ${name} holds {what} at character {bad + 1} of {len(key)}: no HTTP header can carry "
                f"it; set ${name} to the key alone (a key read from a file keeps the file's line end)"
            )
        return key

    def request_options(self) -> dict:
        """The request body's fields besides ``model`` and ``messages``: the sampling options given, as vLLM and
        SGLang take them (a field not given is not sent, so that the server's default applies)."""
        out = {
            k: getattr(self, k)
            for k in ("max_tokens", "temperature", "top_p", "top_k", "seed")
            if getattr(self, k) is not None
        }
        if self.chat_template_kwargs:
            out["chat_template_kwargs"] = json.loads(self.chat_template_kwargs)
        return out

    def settings(self) -> dict:
        """What decides the rows written: a rerun with other settings is another job (``ledger.check_settings``)."""
        return {
            "served_model": self.served_model,
            "request": self.request_options(),
            "turns": self.turns,
            "drop_truncated": self.drop_truncated,
            "dedupe": self.dedupe,
            "data_seed": self.data_seed,
            "compression": self.compression,
        }


def _check_apart(output: str, specs) -> None:
    """The output is neither a data source, nor inside one, nor around one: the chunks written would be read as
    the data, and ``--restart`` would delete the data's files named like chunks."""
    out = _place(output)
    for spec in specs:
        place = _place(spec.location)
        if place is None or out is None or place[0] != out[0]:
            continue
        base = place[1]
        glob_at = next((i for i, part in enumerate(base) if any(c in part for c in "*?[")), None)
        recursive = glob_at is not None and "**" in base[glob_at:]
        if glob_at is not None:
            base = base[:glob_at]
        if out[1] == base:
            relation = "is the place of"
        elif out[1][: len(base)] == base and (glob_at is None or recursive):
            relation = "is inside"
        elif base[: len(out[1])] == out[1]:
            relation = "holds"
        else:
            continue
        raise HsextractError(
            f"--output {redact(output)} {relation} --data {redact(spec.location)}: regenerate would read its own "
            "chunks as data (and --restart delete files there); give an --output apart from every --data"
        )


def _place(location: str) -> tuple[str, tuple[str, ...]] | None:
    """Where a location is, as comparable parts: ``("s3", (bucket, *key parts))`` or ``("file", parts of its real
    path)``; None for a Hub dataset."""
    if location.startswith("hf:"):
        return None
    if location.startswith("s3://"):
        return "s3", tuple(p for p in location[len("s3://") :].split("/") if p)
    return "file", Path(os.path.realpath(os.path.expanduser(location))).parts


def _looks_like_a_name(name: str) -> bool:
    """An environment variable's name as people write them (``OPENAI_API_KEY``), not a key (mixed case, or a long
    run of letters and digits without an underscore)."""
    return bool(re.fullmatch(r"[A-Z_][A-Z0-9_]*", name)) and not (len(name) >= 20 and "_" not in name)


def _endpoint_url(given) -> str:
    if not isinstance(given, str) or not given.strip():
        raise HsextractError(f"--endpoint {given!r} is not a URL: give http://HOST:PORT/v1")
    url = given.strip().rstrip("/")
    if redact(url) != url:
        raise HsextractError(
            f"--endpoint {redact(url)} carries credentials in its URL: give the key through --api-key-env VAR"
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HsextractError(
            f"--endpoint {given!r} is not an http:// or https:// URL: give http://HOST:PORT/v1"
        )
    if not parts.path:
        return url + "/v1"
    path = parts.path
    for route in ROUTES:  # the full path many clients are given: its base is what /models hangs off too
        if path.endswith(route):
            path = path[: -len(route)]
            break
    return urlunsplit(parts._replace(path=path))
