"""Dataset sources read through the ``datasets`` library: ``hf:org/name`` ids, local folders in Hub layout, and
``save_to_disk`` directories.

A Hub id is read as its users would read it (its cache, the offline variables, config, split, revision); a local
folder in Hub layout goes the same way, so its configs and splits mean what they mean on the Hub.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from hsextract.errors import HsextractError
from hsextract.prepare.rows import pick_split, tree_fingerprint


def is_hub_folder(path: Path) -> bool:
    """A dataset repository's layout: a README whose YAML header declares configs, or a ``data/`` folder."""
    readme = path / "README.md"
    if readme.is_file():
        text = readme.read_text(errors="replace")
        header = text.split("\n---", 1)[0] if text.startswith("---") else ""
        if re.search(r"^(configs|dataset_info):", header, re.M):
            return True
    return (path / "data").is_dir()


HUB_PROBE_TIMEOUT_S = 5.0

"""How long a first request to the Hub may take before it counts as unreachable. ``datasets`` itself retries for
much longer before it blames the dataset id."""


def hub_unreachable(endpoint: str, timeout: float = HUB_PROBE_TIMEOUT_S) -> str:
    """Why ``endpoint`` gave no HTTP answer (no DNS, no route, refused, silent), or "" when it answered at all.
    With httpx, as huggingface_hub requests it (the environment's proxies included)."""
    import httpx

    try:
        httpx.head(endpoint, timeout=timeout)  # any answer, an error status included, is an answer
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no answer'}"
    return ""


def load_saved(path: Path, split: str | None, label: str):
    """The split to read of a ``save_to_disk`` directory."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise HsextractError(f"data source {label}: cannot load it with datasets.load_from_disk ({e})") from e
    return pick_split(loaded, split, f"data source {label}")


def load_hub(
    repo: str, *, config: str | None, split: str | None, revision: str | None, label: str, cache: Path | None
) -> tuple[Any, dict]:
    """``datasets.load_dataset`` of a Hub id or a local Hub-layout folder: the split's dataset and its identity."""
    import datasets

    kwargs: dict[str, Any] = {"split": split}
    if revision:
        kwargs["revision"] = revision
    if cache is not None:
        kwargs["cache_dir"] = str(cache)
    local = Path(repo).exists()
    offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", False)) or bool(
        getattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    )
    if not local and not offline and (why := hub_unreachable(datasets.config.HF_ENDPOINT)):
        raise HsextractError(
            f"data source {label}: the Hugging Face Hub ({datasets.config.HF_ENDPOINT}) cannot be reached from "
            f"here ({why}); with no network set HF_HUB_OFFLINE=1 to read the dataset from the local cache "
            f"({datasets.config.HF_DATASETS_CACHE}), or give a local copy of it"
        )
    try:
        loaded = datasets.load_dataset(repo, config, **kwargs)
    except Exception as e:
        if local:
            how = "check its README's configs and its data files, and the config= and split= options"
        elif offline:
            call = f"datasets.load_dataset('{repo}'" + (f", '{config}'" if config else "") + ")"
            how = (
                "this machine is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set) and the dataset is not in "
                f"the local cache ({datasets.config.HF_DATASETS_CACHE}): fill the cache where there is network "
                f'with `python -c "import datasets; {call}"` and copy HF_HOME here, or give a local copy of the '
                "dataset"
            )
        else:
            how = "check the id, config, split and revision, and HF_TOKEN for a gated or private dataset"
        raise HsextractError(
            f"data source {label}: datasets.load_dataset failed ({type(e).__name__}: {e}); {how}"
        ) from None
    dataset = pick_split(loaded, split, f"data source {label}")
    identity = {
        "kind": "hf",
        "id": repo,
        "fingerprint": getattr(dataset, "_fingerprint", ""),
        "config": getattr(dataset.info, "config_name", None) or config,
        "split": str(dataset.split) if dataset.split is not None else split,
        "revision": revision,
    }
    return dataset, identity


def load_hub_folder(
    path: Path,
    *,
    config: str | None,
    split: str | None,
    revision: str | None,
    label: str,
    cache_dir: Path | None,
) -> tuple[Any, dict]:
    """A local folder in Hub layout through ``load_dataset``; its identity is its content hash and options."""
    content = tree_fingerprint(path)
    # datasets keys its cache of a local folder by the folder's name and file names, not their bytes: a folder
    # edited in place would be read from the old cache. A cache per content hash cannot be stale.
    root = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "hsextract"
    options = {"config": config, "split": split, "revision": revision}
    dataset, _ = load_hub(str(path), **options, label=label, cache=root / "datasets" / content[:16])
    return dataset, {"kind": "hub_folder", "hash": content, **{k: v for k, v in options.items() if v}}
