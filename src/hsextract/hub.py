"""What ``--model`` (and ``--tokenizer``) names: a local directory, or a Hub id ``org/name`` resolved to one snapshot.

A Hub id is resolved as transformers resolves it, once, in the launching process: the Hugging Face cache first
(``HF_HOME``, ``HF_HUB_CACHE``), with no network; offline (``HF_HUB_OFFLINE=1``) that is all; online a missing
snapshot is downloaded before any preparation. Every process then reads that one snapshot, whose commit is part of
the plan (a resume on another is refused). A name found nowhere gets the cached ids closest to it (a typo, a case).
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hsextract.errors import HsextractError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


COMMIT = re.compile(r"^[0-9a-f]{40}$")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

"""Files of a model directory that hold weights: never read whole for a key or a fingerprint (tens of GB)."""


IGNORED_FILES = ["original/*", "*.pth", "*.pt", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.ot"]

"""Files a download skips: other frameworks' copies of the weights, which hsextract never reads."""


SIMILAR = 0.85

"""How alike (difflib's ratio, case aside) a cached id must be to a name not found for it to be suggested."""


@dataclass(frozen=True)
class ResolvedModel:
    path: str
    """The local directory every process reads the config, tokenizer and weights from."""
    commit: str | None
    """The Hub commit of that snapshot; None for a local directory."""


def hub_offline(env=None) -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (1, ON, YES, TRUE)."""
    return (os.environ if env is None else env).get("HF_HUB_OFFLINE", "").strip().upper() in {
        "1",
        "ON",
        "YES",
        "TRUE",
    }


def broken_link(path: Path) -> str | None:
    """What is wrong with ``path`` when it is a symbolic link that leads to no file (a loop, a target gone), else
    None: said as such, not as a file that is not there."""
    if not path.is_symlink() or path.exists():
        return None
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"is a symbolic link in a loop ({path} -> {os.readlink(path)} -> ...): link it to the real file"
    return (
        f"is a symbolic link to {os.readlink(path)}, which is not there (a Hub cache's blob removed?): fetch the "
        "file again"
    )


def is_hub_id(name: str) -> bool:
    """``org/name`` that is not a local path."""
    return bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def resolve_model(
    name: str, revision: str | None = None, *, flag: str = "--model", revision_flag: str = "--revision"
) -> ResolvedModel:
    """The directory ``name`` stands for; one clear line when it is neither a directory nor a Hub id found.
    ``flag`` (``--model``, ``--tokenizer``) is the option the messages name; only ``--model`` needs a config.json,
    and a tokenizer's download leaves the weights out."""
    path = Path(name).expanduser()
    if not is_hub_id(name):
        if not path.exists():
            raise HsextractError(
                f"{flag} {name}: no such directory, and not a Hub id of the form org/name either"
                + did_you_mean(name)
            )
        if not path.is_dir():
            raise HsextractError(f"{flag} {name}: a file, not a checkpoint directory")
        if flag == "--model" and not (path / "config.json").exists():
            if (problem := broken_link(path / "config.json")) is not None:
                raise HsextractError(f"--model {name}: config.json {problem}")
            raise HsextractError(
                f"--model {name}: directory has no config.json (is it a transformers checkpoint?)"
            )
        if revision:
            raise HsextractError(
                f"{revision_flag} {revision}: {flag} {name} is a local directory; a revision pins a Hub id"
            )
        return ResolvedModel(str(path), None)
    snapshot = _snapshot(name, revision, (flag, revision_flag), weights=flag == "--model")
    commit = Path(snapshot).name
    return ResolvedModel(snapshot, commit if COMMIT.match(commit) else None)


def resolve_tokenizer(name: str, revision: str | None = None) -> ResolvedModel:
    """The directory ``--tokenizer`` stands for, found as ``--model`` is (a Hub id's snapshot without weights)."""
    return resolve_model(name, revision, flag="--tokenizer", revision_flag="--tokenizer-revision")


def _snapshot(repo_id: str, revision: str | None, flags: tuple[str, str], weights: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    flag, revision_flag = flags
    at = f" at revision {revision}" if revision else ""
    cache = _cache_dir()
    try:  # the cache first: no network, whatever the mode
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    except (OSError, ValueError) as e:
        raise HsextractError(f"{flag} {repo_id}: its Hugging Face cache entry is unreadable ({e})") from e
    if hub_offline():
        raise HsextractError(
            f"{flag} {repo_id}: no such directory, and the Hub id is not in the Hugging Face cache{at} "
            f"({cache}) while offline (HF_HUB_OFFLINE=1): download it where there is network "
            f"(`hf download {repo_id}`) or give a local checkpoint directory{did_you_mean(repo_id)}"
        )
    try:
        skipped = (
            IGNORED_FILES if weights else [*IGNORED_FILES, *(f"*{suffix}" for suffix in WEIGHT_SUFFIXES)]
        )
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, ignore_patterns=skipped)
    except GatedRepoError as e:
        raise HsextractError(
            f"{flag} {repo_id}: the Hub repository is gated; accept its terms and log in (`hf auth login`)"
        ) from e
    except RepositoryNotFoundError as e:
        raise HsextractError(
            f"{flag} {repo_id}: no such directory, and no such Hub repository (or it is private: log in "
            "with `hf auth login`)" + did_you_mean(repo_id)
        ) from e
    except RevisionNotFoundError as e:
        raise HsextractError(f"{revision_flag} {revision}: no such revision of {repo_id} on the Hub") from e
    except Exception as e:  # no network, a proxy, a full disk: one line, with what to do
        raise HsextractError(
            f"{flag} {repo_id}: no such directory, not in the Hugging Face cache{at} ({cache}), and the Hub "
            f"could not be reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "download it where there is network, or set HF_HUB_OFFLINE=1 to use only the cache"
            + did_you_mean(repo_id)
        ) from e


def cached_ids(cache: str | None = None) -> list[str]:
    """The model ids with a snapshot in the Hugging Face cache (``models--org--name/snapshots/<commit>``), from its
    folder names: no import, no network."""
    ids = []
    for entry in sorted(Path(cache or _cache_dir()).glob("models--*")):
        try:
            if any((entry / "snapshots").iterdir()):
                ids.append(entry.name.removeprefix("models--").replace("--", "/"))
        except OSError:  # a bare entry (no snapshot) or an unreadable one is no model to suggest
            continue
    return ids


def closest_ids(name: str, ids: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``ids`` most like ``name``, case aside: as a whole (``org/name``, or the last two parts of a
    path) or by the name alone (``Qwen3.6-27B`` for ``Qwen/Qwen3.6-27B``); none below ``SIMILAR``."""
    parts = [p for p in name.strip().lower().split("/") if p not in ("", ".", "~")]
    if not parts:
        return []
    whole, last = "/".join(parts[-2:]), parts[-1]

    def likeness(cached: str) -> float:
        low = cached.lower()
        return max(
            difflib.SequenceMatcher(None, whole, low).ratio(),
            difflib.SequenceMatcher(None, last, low.rsplit("/", 1)[-1]).ratio(),
        )

    scored = sorted(((likeness(i), i) for i in ids if i != name), key=lambda pair: -pair[0])
    return [i for score, i in scored[:n] if score >= SIMILAR]


def did_you_mean(name: str, cache: str | None = None) -> str:
    """``; did you mean X (in the Hugging Face cache at C)?`` for a name found nowhere, naming the ids cached in
    ``cache`` (default: the one the environment names) closest to it; empty when none is close."""
    cache = cache or _cache_dir()
    close = closest_ids(name, cached_ids(cache))
    return f"; did you mean {' or '.join(close)} (in the Hugging Face cache at {cache})?" if close else ""


def _cache_dir() -> str:
    """Read from the environment now (huggingface_hub reads it once, at its import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def checkpoint_dtype(model_dir: str | Path, known: tuple[str, ...], default: str = "bfloat16") -> str:
    """``--dtype auto``: the dtype ``config.json`` records (``dtype``, or ``torch_dtype`` before transformers 5,
    also under ``text_config``) when it is one of ``known``, else ``default``; as transformers' ``dtype="auto"``."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return default
    for holder in (config, config.get("text_config")) if isinstance(config, dict) else ():
        if isinstance(holder, dict):
            for key in ("dtype", "torch_dtype"):
                if holder.get(key) in known:
                    return holder[key]
    return default
