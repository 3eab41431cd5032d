"""The manifest: written last, from the completion records; an output with one is complete."""

from __future__ import annotations

import json
from collections import Counter

from hsextract import __version__
from hsextract.errors import CorruptOutputError, HsextractError
from hsextract.output.batch import CONVENTION
from hsextract.storage.base import check_key

MANIFEST = "manifest.json"


SAMPLE_INDEX = "sample_index.safetensors"

"""Every sample of the output in one file for the training loader (output/sample_index.py), recorded in the
manifest as ``sample_index``: ``key``, ``size``, ``xxh3``. Outputs written before it have none."""


OUTPUT_FORMAT = "hsextract-output"


OUTPUT_FORMAT_VERSION = 3

"""2: each batch's size, CRC32 and header checksum in the manifest. 3: the state layout (``slot_layer_ids``,
``final_state``, ``storage_dtype``), ``num_layers`` and ``vocab_size``; ``target_topk`` where the files hold the
target's top-k (an addition readers without it ignore, so the version stays)."""


STORED_FIELDS = {"size": int, "crc32": str, "header_size": int, "header_xxh3": str}

"""What the manifest records of each batch file, copied from its completion record."""


def build_manifest(
    *,
    info,
    plan,
    dtype: str,
    sample_ids: list[str],
    data_report: dict,
    stored: dict[str, dict],
    final_norm: dict | None = None,
) -> dict:
    """The manifest of a finished run: run-wide facts and every batch with its sample ids, in plan order.

    ``stored`` maps each batch key to what the uploader recorded of the file in its completion record: ``size``,
    ``crc32`` (8 hex), ``header_size`` and ``header_xxh3`` (the checksum of its first ``header_size`` bytes).
    ``final_norm`` is what ``FinalNorm.read_meta`` found in the output (with the final state only)."""
    layout = info.layout
    final = None
    if layout.final_state:
        final = {"slot": layout.final_slot, "layer": layout.num_layers - 1, "norm": final_norm}
    return {
        "format": OUTPUT_FORMAT,
        "format_version": OUTPUT_FORMAT_VERSION,
        "hsextract_version": __version__,
        "layer_ids": list(info.layer_ids),
        "presets": dict(info.presets),
        "layer_convention": CONVENTION,
        "layer_types": list(info.layer_types),
        "num_layers": info.num_layers,
        "slot_layer_ids": list(layout.slot_layers),
        "final_state": final,
        "storage_dtype": layout.storage_dtype,
        # Only when stored: the manifests of runs without it are as before it existed.
        **({"target_topk": layout.target_topk} if layout.target_topk else {}),
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "dtype": dtype,
        # The linears' numerics: "fp8" (the served FP8 recipe) or "bf16" (none: they ran in ``dtype``).
        "compute": plan.fingerprint.get("compute", "bf16"),
        "plan_hash": plan.plan_hash,
        "fingerprint": plan.fingerprint,
        "num_samples": plan.num_samples,
        "num_tokens": plan.num_tokens,
        "data_report": data_report,
        "batches": [
            {
                "key": b.key,
                "batch_id": b.batch_id,
                "shard": b.shard,
                "num_tokens": b.num_tokens,
                "sample_ids": [sample_ids[i] for i in b.sample_indices],
                **{field: stored[b.key][field] for field in STORED_FIELDS},
            }
            for b in plan.batches
        ],
    }


def write_manifest(sink, manifest: dict) -> None:
    sink.put_bytes(MANIFEST, json.dumps(manifest).encode())


def has_manifest(sink) -> bool:
    return sink.exists(MANIFEST)


def delete_manifest(sink) -> None:
    sink.delete(MANIFEST)


def read_manifest(sink) -> dict:
    """The manifest of the output behind ``sink``, its structure checked: ``HsextractError`` if there is none,
    ``CorruptOutputError`` naming it if it is unreadable or lacks what a reader relies on."""

    def damaged(problem: str) -> CorruptOutputError:
        return CorruptOutputError(sink.url, MANIFEST, f"{problem}; the output is damaged")

    try:
        manifest = json.loads(sink.get_bytes(MANIFEST))  # one request: no lookup before it
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise damaged(f"is not valid JSON ({e})") from None
    except FileNotFoundError:
        if (missing := sink.missing_place()) is not None:
            raise HsextractError(missing) from None
        raise HsextractError(
            f"{sink.url} has no {MANIFEST}: the run has not finished (see `hsextract status RUN_DIR`) "
            "or this is not an hsextract output"
        ) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("batches"), list):
        raise damaged("has no batch list")
    version = manifest.get("format_version")
    if manifest.get("format") != OUTPUT_FORMAT or not isinstance(version, int):
        raise damaged(
            f"is not an {OUTPUT_FORMAT} manifest (format {manifest.get('format')!r}, version {version!r})"
        )
    if version > OUTPUT_FORMAT_VERSION:
        raise HsextractError(
            f"{sink.url}/{MANIFEST} has format version {version}; this hsextract ({__version__}) reads up to "
            f"{OUTPUT_FORMAT_VERSION}: upgrade hsextract"
        )
    layer_ids = manifest.get("layer_ids")
    if not isinstance(layer_ids, list) or not all(isinstance(k, int) for k in layer_ids):
        raise damaged("has no list of layer ids")
    for i, batch in enumerate(manifest["batches"]):
        if not (
            isinstance(batch, dict)
            and isinstance(batch.get("key"), str)
            and isinstance(batch.get("sample_ids"), list)
            and _all_strings(batch["sample_ids"])
        ):
            raise damaged(f"batch entry {i} has no key or no sample ids")
        try:
            check_key(batch["key"])
        except ValueError:
            raise damaged(
                f"batch entry {i} has the key {batch['key']!r}, not a path inside the output"
            ) from None
        if version >= 2 and not all(isinstance(batch.get(f), t) for f, t in STORED_FIELDS.items()):
            raise damaged(f"batch entry {i} ({batch['key']}) lacks its size or checksums")
    index = manifest.get("sample_index")
    if index is not None and not (
        isinstance(index, dict)
        and index.get("key") == SAMPLE_INDEX
        and isinstance(index.get("size"), int)
        and isinstance(index.get("xxh3"), str)
    ):
        raise damaged(f"has a sample_index entry without its key, size or checksum ({index!r})")
    check_fields(manifest, damaged)
    check_consistent(manifest, damaged)
    return manifest


COUNTS = {
    "hidden_size": 1,
    "num_layers": 1,
    "vocab_size": 1,
    "target_topk": 1,
    "num_samples": 0,
    "num_tokens": 0,
}

"""The manifest's figures and their least value: ints (no bool, float or string), where present (None allowed for
``vocab_size`` and ``target_topk``)."""


def check_fields(manifest: dict, damaged) -> None:
    """The manifest's own fields, strictly typed: a figure that is a string, a float, NaN or below its least value
    is named (was: ``hidden_size: "64"`` or ``num_samples: NaN`` passed verify)."""
    for name, least in COUNTS.items():
        value = manifest.get(name)
        if value is None and (name not in manifest or name in ("vocab_size", "target_topk")):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise damaged(f"has {name} {value!r}, not an int of at least {least}")
    for name in ("dtype", "storage_dtype"):
        value = manifest.get(name)
        if name in manifest and not (isinstance(value, str) or (name == "storage_dtype" and value is None)):
            raise damaged(f"has {name} {value!r}, not a dtype's name")
    types = manifest.get("layer_types")
    if types is not None and (
        not isinstance(types, list)
        or len(types) != len(manifest["layer_ids"])
        or not all(isinstance(t, str) for t in types)
    ):
        raise damaged(f"has layer_types {types!r}, not one name per layer id")


def _all_strings(values: list) -> bool:
    """Whether every value is a string, in one C-level pass (``join`` refuses anything else): ~1M sample ids."""
    try:
        "".join(values)
    except TypeError:
        return False
    return True


def require_checksums(sink, manifest: dict, hint: str) -> None:
    """Refuse to check an output written before checksums (format 1): there is nothing to check it against."""
    if manifest["format_version"] < 2:
        raise HsextractError(
            f"{sink.url}/{MANIFEST} was written by an hsextract before checksums (format "
            f"{manifest['format_version']}): {hint}"
        )


def check_consistent(manifest: dict, damaged) -> None:
    """What a manifest says twice must agree (a hand edit changes one place): no batch or sample listed twice,
    as many samples as it counts, the layer ids its fingerprint records."""
    keys, listed = set(), 0
    for batch in manifest["batches"]:
        if batch["key"] in keys:
            raise damaged(f"lists batch {batch['key']} twice")
        keys.add(batch["key"])
        listed += len(batch["sample_ids"])
    if _hashes_repeat(manifest["batches"], listed):  # else no id repeats; if so, which (or a hash collision)
        _check_no_sample_twice(manifest, damaged)
    counted = manifest.get("num_samples")
    if isinstance(counted, int) and counted != listed:
        raise damaged(f"counts {counted} samples but its batches list {listed}")
    planned = (manifest.get("fingerprint") or {}).get("layer_ids")
    if planned is not None and list(planned) != list(manifest["layer_ids"]):
        raise damaged(f"says layer_ids {manifest['layer_ids']} but its fingerprint records {planned}")


def _hashes_repeat(batches: list[dict], listed: int) -> bool:
    """Whether two of the ``listed`` sample ids have the same hash: a sort of ~1M integers, a few times faster
    than a set of the ids (an output's ids are unique but for a hand edit)."""
    import numpy as np

    hashes = np.fromiter(
        (hash(sid) for batch in batches for sid in batch["sample_ids"]), dtype=np.int64, count=listed
    )
    hashes.sort()
    return bool((hashes[1:] == hashes[:-1]).any())


def _check_no_sample_twice(manifest: dict, damaged) -> None:
    """Name the first sample id listed twice, and the batch that lists it again."""
    sample_ids, listed = set(), 0
    for batch in manifest["batches"]:
        sample_ids.update(batch["sample_ids"])
        listed += len(batch["sample_ids"])
        if len(sample_ids) != listed:
            before = _before(manifest, batch)
            again = next(sid for sid, n in Counter(batch["sample_ids"]).items() if n > 1 or sid in before)
            raise damaged(f"lists sample {again!r} twice (again in {batch['key']})")


def _before(manifest: dict, batch: dict) -> set[str]:
    """The sample ids of the batches listed before ``batch`` (to name a repeated one)."""
    seen: set[str] = set()
    for b in manifest["batches"]:
        if b is batch:
            return seen
        seen.update(b["sample_ids"])
    return seen


def header_expectations(manifest: dict, entry: dict) -> dict:
    """What the header of the batch file ``entry`` must say, from the manifest: the run's plan and layer ids, the
    batch's id and shard (its sample ids are compared apart). A header field a file lacks is not compared."""
    expect = {"plan_hash": manifest.get("plan_hash"), "layer_ids": list(manifest["layer_ids"])}
    if "slot_layer_ids" in manifest:
        expect["slot_layer_ids"] = list(manifest["slot_layer_ids"])
    if manifest.get("target_topk"):
        expect["target_topk"] = manifest["target_topk"]
    for field in ("dtype", "hidden_size"):  # what the files say of their states, against the manifest's word
        if field in manifest:
            expect[field] = manifest[field]
    if "storage_dtype" in manifest:
        expect["storage_dtype"] = manifest["storage_dtype"] or ""
    for field in ("batch_id", "shard"):
        if field in entry:
            expect[field] = entry[field]
    return {k: v for k, v in expect.items() if v is not None}


def header_mismatch(metadata: dict[str, str], expect: dict) -> str | None:
    """How a batch file's header ``metadata`` contradicts ``expect`` (``header_expectations``), or None."""
    for field, want in expect.items():
        got = metadata.get(field)
        if got is None:
            continue
        if isinstance(want, list):
            try:
                same = json.loads(got) == want
            except ValueError:
                same = False
        else:
            same = got == str(want)
        if not same:
            return f"its header says {field} {got}, the manifest {want}"
    return None
