"""SpecForge's seam: its data plane's ``FeatureStore`` and ``OfflineManifestReader`` over an output.

``OutputManifestReader`` makes the refs SpecForge's reader makes, one per sample the schema serves, and
``OutputFeatureStore.get`` returns a sample's record as ``data_I.ckpt`` of ``hsextract export`` holds it, so
SpecForge's ``FeatureDataLoader``, normalizer and collator run unchanged. docs/TRAINING.md shows it in use.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import torch
from specforge.runtime.contracts import FeatureHandle, SampleRef
from specforge.runtime.data_plane.feature_store import FeatureStore
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

from hsextract.errors import HsextractError
from hsextract.training.dataset import StatesMapDataset

URI_SCHEME = "hsextract://"

# What SpecForge's own build_offline_reader asks for, per schema: (feature keys, target_repr).
_READER_KEYS = {
    "specforge-eagle3": (("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"), "hidden_state"),
    "specforge-dflash": (("input_ids", "loss_mask", "hidden_states"), None),
}


class OutputFeatureStore(FeatureStore):
    """A read-only ``FeatureStore`` serving an output's samples as SpecForge's offline records."""

    def __init__(
        self,
        output,
        schema: str,
        *,
        endpoint_url: str | None = None,
        verify: bool = True,
        dtype=torch.bfloat16,
    ):
        if schema not in _READER_KEYS:
            raise HsextractError(f"schema {schema!r} is not a SpecForge one ({', '.join(_READER_KEYS)})")
        self.schema = schema
        self.data = StatesMapDataset(output, schema, endpoint_url=endpoint_url, verify=verify, dtype=dtype)
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def put(self, tensors, *, sample_id, metadata):
        raise NotImplementedError("an hsextract output is read-only: SpecForge's offline mode only reads it")

    def get(self, sample_ref: SampleRef, *, device="cpu", names=None):
        uri = sample_ref.feature_store_uri
        if not uri.startswith(URI_SCHEME):
            raise KeyError(
                f"{uri} is not a sample of an hsextract output (refs come from OutputManifestReader)"
            )
        record = self.data.record(int(uri[len(URI_SCHEME) :]))
        wanted = names or list(sample_ref.feature_keys)
        tensors = {n: record[sample_ref.feature_keys.get(n, n)] for n in wanted}
        if str(device) != "cpu":
            tensors = {k: v.to(device) for k, v in tensors.items()}
        with self._lock:
            token = next(self._counter)
        return tensors, FeatureHandle(sample_ref.sample_id, 0, f"{sample_ref.sample_id}:0:{token}")

    def release(self, handle, *, reason="consumed") -> None:
        pass  # nothing is resident: each get reads the sample afresh

    def abort(self, sample_id, *, reason="aborted") -> None:
        pass

    def health(self) -> dict:
        return {"backend": "hsextract", "samples": len(self.data), "resident_samples": 0, "resident_bytes": 0}


class OutputManifestReader(OfflineManifestReader):
    """SpecForge's ``SampleRef`` per sample of the store's output (manifest order), with its reader's metadata."""

    def __init__(self, store: OutputFeatureStore, *, strategy: str | None = None, run_id="offline", **kwargs):
        keys, target_repr = _READER_KEYS[store.schema]
        strategy = strategy or ("eagle3" if store.schema == "specforge-eagle3" else "dflash")
        super().__init__(
            store.data.index.where.path,
            run_id=run_id,
            strategy=strategy,
            feature_keys=keys,
            target_repr=target_repr,
            validate_files=False,
            **kwargs,
        )
        self.store = store

    def __iter__(self):
        data = self.store.data
        for index, n in enumerate(data.lengths):
            ref = self._ref_for(index, data.sample_ids[index])
            yield dataclasses.replace(ref, feature_store_uri=f"{URI_SCHEME}{index}", num_tokens=n)
