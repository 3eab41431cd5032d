"""What trainers call: ``open_output(path)`` over a local directory or ``s3://bucket/prefix``.

A sample costs one ranged read of its states, never a whole batch file. Verification costs no extra read and is on
by default: a header against the manifest's checksum, a sample against its own; anything wrong raises
``CorruptOutputError`` naming the file. docs/TRAINING.md shows it in use and docs/FORMAT.md what a sample holds.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from functools import cached_property
from typing import TYPE_CHECKING

from hsextract.errors import HsextractError
from hsextract.layers import PRESETS, preset_layer_ids
from hsextract.output.batch import StateLayout
from hsextract.output.batchfile import BatchFile, SampleView, plain_memory
from hsextract.output.final_norm import read_final_norm
from hsextract.output.manifest import read_manifest, require_checksums
from hsextract.storage import open_sink

if TYPE_CHECKING:
    import torch

__all__ = ["BatchFile", "Output", "SampleView", "open_output", "plain_memory"]


class Output:
    """A finished hsextract output. Indexing by sample id and iteration read lazily."""

    def __init__(
        self,
        path: str,
        endpoint_url: str | None = None,
        cache_files: int = 8,
        retry_deadline_s: float = 120,
        verify: bool = True,
        *,
        dequantize: bool = True,
        dtype: torch.dtype | None = None,
        manifest: dict | None = None,
        cache_dir: str | None = None,
        cache_max_gb: float = 100.0,
        layers=None,
    ):
        # A trainer should hear about an unreachable bucket within minutes, not after the uploader's 30-minute patience.
        self.sink = open_sink(path, endpoint_url, retry_deadline_s=retry_deadline_s, reading=True)
        # ``manifest``: one read already (a training process's index), or the live view of an output still being
        # written (training/follow.py), whose batch entries are filled in as their completion records appear.
        self.manifest = read_manifest(self.sink) if manifest is None else manifest
        self.verify = verify
        if verify:
            require_checksums(
                self.sink, self.manifest, "it cannot be verified; open_output(..., verify=False) reads it"
            )
        if cache_dir is not None:  # batch files and final norm in blocks on local disk (storage/cache.py)
            from hsextract.storage.cache import CachedSink, cache_limit, manifest_versions

            versions, limit = manifest_versions(self.manifest), cache_limit(cache_max_gb)
            self.sink = CachedSink(self.sink, cache_dir, limit, versions, identity=f"{endpoint_url}|{path}")
        self.metadata: dict = self.manifest
        self._entries = {batch["key"]: batch for batch in self.manifest["batches"]}
        self.layout = StateLayout.from_manifest(self.manifest)
        served = served_layers(self.manifest, layers)
        self.layer_ids: tuple[int, ...] = served or self.layout.layer_ids
        """The layer ids each sample serves, in the order served."""
        self.target_topk: int | None = self.layout.target_topk
        """K of the target's top-k each sample holds (``--target-topk``), or None."""
        norm = None
        if self.layout.final_state:
            norm = read_final_norm(self.sink, self.manifest["final_state"]["norm"], verify=verify)
        self._view = SampleView(self.layout, norm, dequantize, dtype, served)
        self._files: OrderedDict[str, BatchFile] = OrderedDict()
        self._cache_files = cache_files

    # Made on first use, not when the output is opened: at ~1M samples they take seconds and hundreds of MB, which
    # a training process (it reads by index: training/index.py) never needs.
    @cached_property
    def _order(self) -> list[str]:
        return [sid for batch in self.manifest["batches"] for sid in batch["sample_ids"]]

    @cached_property
    def _where(self) -> dict[str, tuple[str, int]]:
        return {
            sid: (batch["key"], row)
            for batch in self.manifest["batches"]
            for row, sid in enumerate(batch["sample_ids"])
        }

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, sample_id) -> bool:
        return str(sample_id) in self._where

    def sample_ids(self) -> list[str]:
        return list(self._order)

    def batch_file(self, key: str) -> BatchFile:
        """The batch file under ``key`` (header cached): ``read_all("input_ids")``, ``cu_seqlens``..."""
        return self._file(key)

    def batch_samples(self, key: str):
        """Every sample of one batch file, in row order."""
        f = self._file(key)
        for row in range(len(f.sample_ids)):
            yield f.sample(row, self._view)

    def _file(self, key: str) -> BatchFile:
        f = self._files.pop(key, None) or BatchFile.listed(
            self.sink, self.manifest, self._entries[key], verify=self.verify
        )
        self._files[key] = f
        while len(self._files) > self._cache_files:
            self._files.popitem(last=False)
        return f

    def open_batch_file(self, key: str, sample_ids: list[str] | None = None) -> BatchFile:
        """A new ``BatchFile`` for ``key``, outside the cache (the training loader keeps its own, one per thread).
        ``sample_ids``: what its header must list, where the manifest given holds none (the sample index's)."""
        entry = self._entries[key] if sample_ids is None else {**self._entries[key], "sample_ids": sample_ids}
        return BatchFile(self.sink, key, entry, verify=self.verify)

    def read_sample(self, f: BatchFile, row: int) -> dict:
        """Sample ``row`` of the open batch file ``f`` as this output's reader dict (checked, fp8 dequantized)."""
        return f.sample(row, self._view)

    def read_samples(self, f: BatchFile, rows: list[int], alloc=plain_memory) -> dict:
        """Rows (ascending) of the open batch file ``f`` in one read of their states (``BatchFile.samples``)."""
        return f.samples(rows, self._view, alloc)

    def __getitem__(self, sample_id) -> dict:
        try:
            key, row = self._where[str(sample_id)]
        except KeyError:
            raise KeyError(
                f"sample {sample_id!r} is not in this output{self._id_hint(str(sample_id))}"
            ) from None
        return self._file(key).sample(row, self._view)

    def _id_hint(self, sample_id: str) -> str:
        """For a missed id: the ids of a mix of sources are ``name/id`` (only scanned on a miss)."""
        matches = [i for i in self._order if i.endswith("/" + sample_id)][:3]
        if matches:
            return f"; ids of a mix of sources carry the source's name: {', '.join(map(repr, matches))}"
        first = self._order[0] if self._order else ""
        return f" (its ids read like {first!r})" if "/" in first else ""

    def __iter__(self):
        for batch in self.manifest["batches"]:
            yield from self.batch_samples(batch["key"])


def _layer_ids(layers) -> tuple[int, ...]:
    """Layer ids from ``"1,3"`` or a sequence of ints, strictly (no ``4.7`` served as 4, no ``False`` as 0);
    ``ValueError`` for a string that is not ids (a preset's name, perhaps)."""
    if isinstance(layers, str):
        parts = [p.strip() for p in layers.split(",") if p.strip()]
        if not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(layers)
        return tuple(int(p) for p in parts)
    try:
        parts = list(layers)
    except TypeError:
        raise HsextractError(f"layers={layers!r} is neither layer ids nor a preset's name") from None
    bad = [k for k in parts if isinstance(k, bool) or not isinstance(k, numbers.Integral)]
    if bad:
        raise HsextractError(f"layers={layers!r}: {bad[0]!r} is not a layer id (an int)")
    return tuple(int(k) for k in parts)


def served_layers(manifest: dict, layers) -> tuple[int, ...] | None:
    """The layer ids to serve for ``layers``: None (every captured layer), a preset name the output records (or
    whose ids, computed from the depth, it stores), or ids in the order wanted, each one the output stores."""
    if layers is None:
        return None
    stored = StateLayout.from_manifest(manifest)
    try:
        ids = _layer_ids(layers)
    except ValueError:
        name, presets = layers.strip().lower(), manifest.get("presets") or {}
        if name in presets:
            return tuple(presets[name])
        if name not in PRESETS:
            raise HsextractError(
                f"layers={layers!r} is neither a preset ({', '.join(PRESETS)}) nor layer ids; this output records "
                f"the presets {sorted(presets) or 'none'} and stores the layers {list(stored.layer_ids)}"
            ) from None
        ids = preset_layer_ids(name, stored.num_layers)  # an output that records no presets: by its depth
    missing = [k for k in ids if k not in stored.slot_layers]
    if missing or not ids or len(set(ids)) != len(ids):
        raise HsextractError(
            f"layers={layers!r} ({list(ids)}) cannot be served: this output stores the layers "
            f"{list(stored.layer_ids)}"
            + (f" and the final state (layer {stored.num_layers - 1})" if stored.final_state else "")
            + (f", recording the presets {manifest['presets']}" if manifest.get("presets") else "")
            + ("; ask for each stored id at most once" if ids and not missing else "")
            + (f"; {missing} are not stored: extract them (--layers) or ask for others" if missing else "")
        )
    return tuple(ids)


def open_output(
    path: str,
    endpoint_url: str | None = None,
    *,
    retry_deadline_s: float = 120,
    verify: bool = True,
    dequantize: bool = True,
    dtype: torch.dtype | None = None,
    layers=None,
    **options,
) -> Output:
    """Open a finished output (a local directory or ``s3://bucket/prefix``) for reading. Transient S3 errors are
    retried for ``retry_deadline_s`` seconds before a read fails. With ``verify`` (the default) every header and
    sample read is checked against its checksum; a damaged file raises ``CorruptOutputError``. fp8 states are
    dequantized to ``dtype`` (None: bfloat16) unless ``dequantize=False``. ``options``: ``cache_dir=`` keeps what is
    read in a local disk cache of at most ``cache_max_gb=`` (100) (storage/cache.py), for reading an S3 output many
    times; ``manifest=`` the manifest read already. ``layers``: serve only these stored layers, in this order (ids, or a
    preset such as ``"dflash2"``; ``served_layers``)."""
    return Output(
        str(path),
        endpoint_url,
        retry_deadline_s=retry_deadline_s,
        verify=verify,
        dequantize=dequantize,
        dtype=dtype,
        layers=layers,
        **options,
    )
