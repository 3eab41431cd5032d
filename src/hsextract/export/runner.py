"""``hsextract export OUTPUT DEST --format F``: a finished output rewritten as the files a drafter trainer reads.

An export is the training dataset plus a file writer (the schema's records, training/schemas.py), so an export and
``hsextract.training`` cannot disagree. One unit of work is one batch file, marked done after its last file, so a
rerun skips marked units; ``export.json``, written last, says an export is complete, and ``spec.json``, written
first, makes a DEST holding anything else refused. docs/EXPORT.md has the formats.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from hsextract import __version__
from hsextract.errors import HsextractError, install_redaction
from hsextract.export.formats import FORMATS, ExportFormat, _torch_bytes, vocab_mapping
from hsextract.storage import open_sink
from hsextract.training.index import SampleIndex, SampleReader, index_output

STATE_DIR = ".hsextract-export"


SPEC_KEY = f"{STATE_DIR}/spec.json"


DONE_PREFIX = f"{STATE_DIR}/done/"


COMPLETE_KEY = "export.json"


@dataclass(frozen=True)
class Unit:
    key: str  # the batch file
    start: int  # global index of its first sample, in manifest order
    sample_ids: tuple[str, ...]

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def marker(self) -> str:
        return DONE_PREFIX + self.key.rsplit("/", 1)[-1].removesuffix(".safetensors") + ".json"


def units_of(manifest: dict) -> list[Unit]:
    units, start = [], 0
    for b in manifest["batches"]:
        units.append(Unit(b["key"], start, tuple(b["sample_ids"])))
        start += len(b["sample_ids"])
    return units


READ_THREADS = 4

"""Threads reading and serializing samples, shared out among the export processes (at least one each), each
keeping 4 samples per thread ahead of its writes (``StatesDataset``'s defaults in one process). Few, because
threads beyond the cores to spare slowed the export down."""


_proc: dict = {}


def _open_process(
    index: SampleIndex, dest_url: str, endpoint_url: str | None, fmt_name: str, threads: int
) -> None:
    """Once per export process: the output read as the training dataset reads it, the destination opened."""
    _proc.update(
        reader=SampleReader(index),
        dest=open_sink(dest_url, endpoint_url),
        fmt=FORMATS[fmt_name],
        threads=threads,
    )


def _open_pool_process(*args) -> None:
    install_redaction()  # a spawned child of the command: its storage retry lines name the endpoint
    torch.set_num_threads(1)
    _open_process(*args)


def _export_unit(unit: Unit) -> dict:
    """Every sample of one batch file the format serves to its files, then the unit's marker. The samples are those
    the training dataset serves and are read as it reads them (``SampleReader.stream``: neighbouring rows in one
    read, checked, serialized by the reading threads); the files hold the schema's record of each."""
    reader, dest, fmt, threads = _proc["reader"], _proc["dest"], _proc["fmt"], _proc["threads"]
    index = reader.index

    def files(i: int, s: dict) -> dict[str, bytes]:
        return fmt.sample_files(unit.start + index.rows[i], s)

    written = 0
    samples = index.file_samples[unit.key]
    for sample_files in reader.stream(samples, files, threads=threads, prefetch=4 * threads):
        for key, data in sample_files.items():
            dest.put_bytes(key, data)
        written += 1
    skipped = {sid: index.skipped[sid] for sid in unit.sample_ids if sid in index.skipped}
    summary = {"batch": unit.key, "samples": unit.num_samples, "written": written, "skipped": skipped}
    dest.put_bytes(unit.marker, json.dumps(summary).encode())
    return summary


def _spec(fmt: ExportFormat, manifest: dict, draft_vocab: int | None, index_only: bool) -> dict:
    spec = {
        "format": fmt.name,
        "source": {
            "plan_hash": manifest.get("plan_hash"),
            "num_samples": manifest.get("num_samples"),
            "num_tokens": manifest.get("num_tokens"),
            "layer_ids": manifest.get("layer_ids"),
        },
        "draft_vocab": draft_vocab,
    }
    if index_only:  # only then: an index-only export is another export than a full one
        spec["index_only"] = True
    return spec


def _claim_dest(dest, spec: dict, dest_url: str) -> None:
    """Write the spec on a first attempt; on a rerun it must be the same export, else nothing is touched."""
    if dest.exists(SPEC_KEY):
        old = json.loads(dest.get_bytes(SPEC_KEY))
        old.pop("hsextract_version", None)
        if old != spec:
            raise HsextractError(
                f"{dest_url} holds another export: {'; '.join(_spec_differences(old, spec))}. "
                "Choose another DEST or delete that export first"
            )
        return
    existing = dest.list_keys("")
    if existing:
        raise HsextractError(
            f"{dest_url} is not empty ({len(existing)} file(s), e.g. {existing[0]}) and holds no hsextract export: "
            "choose an empty or new DEST"
        )
    dest.put_bytes(SPEC_KEY, json.dumps({**spec, "hsextract_version": __version__}).encode())


_SPEC_WORDS = {
    "format": "format",
    "draft_vocab": "--draft-vocab",
    "index_only": "--index-only",
    "plan_hash": "source output (its plan)",
    "num_samples": "source output's sample count",
    "num_tokens": "source output's token count",
    "layer_ids": "source output's layer ids",
}


def _spec_differences(old: dict, new: dict) -> list[str]:
    """Each field in which the export in DEST differs from this one, in words: ``format: speculators there,
    modelopt now``."""

    def flat(spec: dict) -> dict:
        return {**{k: v for k, v in spec.items() if k != "source"}, **spec.get("source", {})}

    def shown(value) -> str:
        return "none" if value is None or value is False else str(value)

    before, now = flat(old), flat(new)
    return [
        f"{_SPEC_WORDS.get(key, key)}: {shown(before.get(key))} there, {shown(now.get(key))} now"
        for key in dict.fromkeys([*now, *before])
        if before.get(key) != now.get(key)
    ]


def _kept_rows(out, index: SampleIndex, units: list[Unit], progress):
    """(index, input_ids, loss_mask) of every exported sample, batch by batch: the token ids and masks only, which
    a batch file holds from its opening on (reader.BatchFile)."""
    for unit in units:
        f = out.batch_file(unit.key)
        ids, mask = f.read_all("input_ids").long(), f.read_all("loss_mask")
        for i in index.file_samples[unit.key]:
            a, b = index.starts[i], index.starts[i] + index.lengths[i]
            yield unit.start + index.rows[i], ids[a:b], mask[a:b]
        progress(unit.num_samples)


def check_vocab_options(draft_vocab: int | None, target_vocab_size: int | None, recorded: int | None):
    """The target vocabulary size to map into, checked before anything is written: a bad value found after the
    sample files would be recorded in DEST and refuse the corrected rerun as another export."""
    if target_vocab_size is not None:
        if target_vocab_size < 1:
            raise HsextractError(
                f"--target-vocab-size must be a positive number of tokens, got {target_vocab_size}"
            )
        if recorded and target_vocab_size != recorded:
            raise HsextractError(
                f"--target-vocab-size {target_vocab_size} differs from the {recorded} tokens this output's "
                "manifest records: leave the option out (it is for outputs whose manifest lacks the size)"
            )
    vocab = target_vocab_size or recorded
    if draft_vocab is None:
        return vocab
    if not vocab:
        raise HsextractError(
            "--draft-vocab needs the target vocabulary size, which this output's manifest does not record: "
            "give --target-vocab-size"
        )
    if not 0 < draft_vocab <= vocab:
        raise HsextractError(f"--draft-vocab {draft_vocab} must be in 1..{vocab} (the target vocabulary)")
    return vocab


def check_manifest_vocab(source: str, endpoint_url: str | None, recorded: int) -> None:
    """The manifest's vocabulary is the one the run recorded (its sealed ``hsextract/run.json``): an edited one
    is named with its fix, not met as a token id past it after the sample files are written."""
    from hsextract.output.ledger import load_plan

    sink = open_sink(source, endpoint_url)
    if not sink.exists("hsextract/run.json"):
        return  # an output of an hsextract older than the job files: the manifest is all there is
    _plan, info = load_plan(sink)
    if info.vocab_size is not None and info.vocab_size != recorded:
        raise HsextractError(
            f"{source}'s manifest records a vocabulary of {recorded} tokens, its hsextract/run.json {info.vocab_size}: the "
            f"manifest was edited or damaged; `hsextract finalize {source}` writes it again from the output's "
            "job files, then export again (no --target-vocab-size needed)"
        )


def export(
    source: str,
    dest_url: str,
    fmt_name: str,
    *,
    draft_vocab: int | None = None,
    target_vocab_size: int | None = None,
    num_proc: int | None = None,
    endpoint_url: str | None = None,
    index_only: bool = False,
    layers=None,
    seq_length: int | None = None,
    shard_size: int | None = None,
    show_progress: bool = True,
    echo=print,
) -> dict:
    """Export the finished output at ``source`` to ``dest_url`` in format ``fmt_name``; resumes a cut-short export.
    ``index_only`` (speculators) writes the table and the statistics, no states: the trainer reads those from the
    output through ``hsextract.training.speculators.OutputTransfer``. ``layers``: the stored layers exported, in
    order (ids or a preset the output records; by default the format's own preset of a union output, else every
    captured layer). ``seq_length`` and ``shard_size``: the padded length and samples per shard of a sharded cache
    (``nemo-dspark``; by default the output's --max-length and 16). Returns what ``export.json`` holds."""
    from tqdm import tqdm

    from hsextract.output import open_output, served_layers

    if fmt_name not in FORMATS:
        raise HsextractError(f"--format {fmt_name!r} is not one of {', '.join(FORMATS)}")
    for name, value in (("--seq-length", seq_length), ("--shard-size", shard_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HsextractError(f"{name} must be a positive number of tokens or samples, got {value!r}")
    fmt = FORMATS[fmt_name]
    out = open_output(source, endpoint_url)
    manifest = out.manifest
    layers = fmt.schema.layers_for(manifest, layers)
    fmt.check(manifest, served_layers(manifest, layers) or out.layer_ids)
    if (draft_vocab is not None or target_vocab_size is not None) and manifest.get("vocab_size"):
        check_manifest_vocab(source, endpoint_url, manifest["vocab_size"])
    vocab = check_vocab_options(draft_vocab, target_vocab_size, manifest.get("vocab_size"))
    num_proc = default_num_proc() if num_proc is None else num_proc
    if num_proc < 1:
        raise HsextractError(f"--num-proc must be at least 1, got {num_proc}")
    if index_only and fmt.name != "speculators":
        raise HsextractError(
            f"--index-only is for --format speculators (its table names the samples; the states come from the "
            f"output through a HiddenStatesTransfer); --format {fmt.name} has no such seam"
        )

    schema, cache = fmt.schema, None
    if not fmt.per_sample:  # a sharded cache of fixed-length rows (export/nemo.py)
        cache = {
            "seq_length": seq_length or (manifest.get("fingerprint") or {}).get("max_length") or 4096,
            "shard_size": shard_size or 16,
        }
        schema = fmt.schema_for(cache["seq_length"])
    elif seq_length is not None or shard_size is not None:
        raise HsextractError(
            f"--seq-length and --shard-size are for sharded caches (nemo-dspark), not {fmt.name}"
        )
    # What the training dataset serves of this output, the samples the format's trainer cannot take left out.
    index = index_output(source, schema, endpoint_url=endpoint_url, layers=layers)
    served = {**manifest, "layer_ids": list(index.layer_ids)}  # what the trainer is told it reads
    dest = open_sink(dest_url, endpoint_url)
    spec = _spec(fmt, served, draft_vocab, index_only)
    if cache:
        spec["cache"] = cache
    _claim_dest(dest, spec, dest_url)
    if dest.exists(COMPLETE_KEY):
        echo(f"{dest_url} already holds this export, complete")
        return json.loads(dest.get_bytes(COMPLETE_KEY))
    # Local temporary files (or open multipart uploads) of an export that was killed mid-write.
    dest.discard_partials("")

    units = units_of(manifest)
    done = set(dest.list_keys(DONE_PREFIX))
    todo = [] if index_only or cache else [u for u in units if u.marker not in done]
    total = sum(u.num_samples for u in units)
    bar = tqdm(
        total=total, desc=f"export {fmt.name}", unit="sample", disable=not show_progress, dynamic_ncols=True
    )
    bar.update(0 if cache else total - sum(u.num_samples for u in todo))
    t0 = time.time()
    processes = 1 if num_proc == 1 or len(todo) <= 1 else min(num_proc, len(todo))
    opening = (index, dest_url, endpoint_url, fmt.name, max(1, READ_THREADS // processes))
    if processes == 1:
        if todo:
            _open_process(*opening)
        for unit in todo:
            bar.update(_export_unit(unit)["samples"])
    else:
        import multiprocessing as mp

        # spawn, not fork: the parent holds torch and tqdm threads; a forked child could inherit a held lock.
        with mp.get_context("spawn").Pool(
            processes, initializer=_open_pool_process, initargs=opening
        ) as pool:
            for summary in pool.imap_unordered(_export_unit, todo):
                bar.update(summary["samples"])
    if cache:
        fmt.write_cache(dest, index, SampleReader(index), threads=READ_THREADS, progress=bar.update, **cache)
        bar.update(len(index.skipped))
    bar.close()

    # Everything per sample is durable; now the files about the whole export, from the markers and a pass over
    # the token ids and loss masks.
    if index_only:  # speculators leaves no sample out
        summaries = [{"skipped": {}, "written": u.num_samples} for u in units]
    elif cache:
        summaries = [{"skipped": index.skipped, "written": len(index)}]
    else:
        summaries = [json.loads(dest.get_bytes(u.marker)) for u in units]
    skipped = {sid: why for s in summaries for sid, why in s["skipped"].items()}
    written = sum(s["written"] for s in summaries)
    token_freq: Counter = Counter()
    stats_bar = tqdm(total=total, desc="token statistics", unit="sample", disable=not show_progress)

    def counted_rows():
        for position, ids, mask in _kept_rows(out, index, units, stats_bar.update):
            token_freq.update(ids[mask.bool()].tolist())
            yield position, ids, mask

    with tempfile.TemporaryDirectory(prefix="hsextract-export-") as workdir:
        with _datasets_bars(show_progress):
            fmt.finish(dest, counted_rows(), workdir)
    stats_bar.close()
    dest.put_bytes("token_freq.pt", _torch_bytes(dict(sorted(token_freq.items()))))
    if draft_vocab is not None:
        if token_freq and max(token_freq) >= vocab:
            where = "--target-vocab-size" if target_vocab_size else "the manifest's vocab_size"
            raise HsextractError(
                f"{where} {vocab}: the output holds token id {max(token_freq)}; give --target-vocab-size the "
                "model's vocabulary size (its config.json's vocab_size)"
            )
        d2t, t2d = vocab_mapping(token_freq, draft_vocab, vocab)
        for key, data in fmt.vocab_mapping_files(d2t, t2d).items():
            dest.put_bytes(key, data)
    result = {
        **spec,
        "hsextract_version": __version__,
        "samples_exported": written,
        "samples_skipped": len(skipped),
        "skipped": skipped,
        "loss_tokens": sum(token_freq.values()),
        "train_with": {
            **fmt.train_hint(served, _where(dest_url), draft_vocab),
            **(
                {"transfer": f"hsextract.training.speculators.OutputTransfer({source!r})"}
                if index_only
                else {}
            ),
        },
        "seconds": round(time.time() - t0, 1),
    }
    dest.put_bytes(COMPLETE_KEY, json.dumps(result, indent=2).encode())
    echo(
        f"exported {written} of {total} samples to {dest_url} as {fmt.name}"
        + (f"; {len(skipped)} skipped ({next(iter(set(skipped.values())))})" if skipped else "")
    )
    echo(f"train with: {result['train_with']['command']}")
    echo(f"  layer ids {result['train_with']['layer_ids']}: {result['train_with']['where']}")
    if setup := result["train_with"].get("setup"):
        echo(f"  {setup}")
    return result


def default_num_proc() -> int:
    """The export's processes: the cores this process may use, at most 8 (more only adds start-up time)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


@contextlib.contextmanager
def _datasets_bars(show: bool):
    """The ``datasets`` library's own progress bars (saving a table) follow ``--no-progress``; restored after."""
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    if not show:
        ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not show:
            ds_logging.enable_progress_bar()


def _where(url: str) -> str:
    """DEST as a trainer on this machine is given it: an absolute path, or the URL."""
    return url.rstrip("/") if "://" in url else str(Path(url).expanduser().resolve())


__all__ = ["FORMATS", "export", "vocab_mapping"]
