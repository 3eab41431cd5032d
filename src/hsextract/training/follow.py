"""Training on an output that is still being written: ``StatesDataset(output, follow=True)``.

The plan is in the output from its start, so every sample is dealt to its rank and worker up front with no
coordination; each process admits samples as their completion records appear and ends the epoch at the manifest.
The order depends on when batches complete, so each process journals what it served for ``state_dict``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from torch.utils.data import get_worker_info

from hsextract.errors import HsextractError
from hsextract.output import FinalNorm, Output, read_manifest, served_layers
from hsextract.output.ledger import STORED_FIELDS, done_in_output, has_manifest, live_manifest, read_done
from hsextract.storage import open_sink
from hsextract.training.index import Where, open_where
from hsextract.training.order import rank_sequence, worker_share
from hsextract.training.schemas import Schema
from hsextract.training.state import anything, check_state, count, is_int, sealed, seconds

log = logging.getLogger(__name__)


class Follow:
    """The followed side of a ``StatesDataset``: the job's samples, who serves each, and resume. Made where the
    dataset is made, pickled into DataLoader workers, which open the output themselves."""

    def __init__(
        self, where: Where, schema: Schema, *, rank: int, world_size: int, poll_s: float, timeout_s: float
    ):
        poll_s, timeout_s = seconds("poll_s", poll_s), seconds("follow_timeout_s", timeout_s)
        self.where, self.schema = where, schema
        self.rank, self.world_size = rank, world_size
        self.poll_s, self.timeout_s = poll_s, timeout_s
        sink = open_sink(
            where.path, where.endpoint_url, retry_deadline_s=where.retry_deadline_s, reading=True
        )
        self.manifest = _waiting(
            lambda: live_manifest(sink), f"the job files of {sink.url}", poll_s, timeout_s
        )
        layers = schema.layers_for(self.manifest, where.layers)  # a union's: the schema's own preset
        self.where = replace(where, layers=layers)
        schema.check(self.manifest, served_layers(self.manifest, layers) or tuple(self.manifest["layer_ids"]))
        self.keys = [b["key"] for b in self.manifest["batches"]]
        self.starts: dict[str, int] = {}  # plan position of each file's first sample
        n = 0
        for b in self.manifest["batches"]:
            self.starts[b["key"]], n = n, n + len(b["sample_ids"])
        self.num_samples = n
        self.consumed: set[int] = set()  # positions of this rank consumed this epoch before the resume point
        self.prior = 0  # how many: the consumed count of the state resumed from
        self.generation = 0  # bumped by every new epoch or resume: names this iteration's journals
        self.journal = Path(tempfile.mkdtemp(prefix="hsextract-follow-"))
        weakref.finalize(self, _remove_journal, self.journal, os.getpid())

    # -- who serves what ----------------------------------------------------------------------------------------
    def rank_positions(self, epoch: int, seed: int, shuffle: bool) -> list[int]:
        """This rank's samples (plan positions) this epoch, in the order they are dealt to its workers."""
        order = list(range(self.num_samples))
        if shuffle:
            random.Random(f"hsextract-follow:{seed}:{epoch}").shuffle(order)
        return rank_sequence(order, self.rank, self.world_size)

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))

    def new_epoch(self) -> None:
        self.consumed, self.prior, self.generation = set(), 0, self.generation + 1

    # -- serving ------------------------------------------------------------------------------------------------
    def items(self, ds):
        """This process's share of the rank's samples, as their batch files complete (``ds``: the dataset, for its
        epoch, seed, shuffle, batch size, window, threads and prefetch)."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        left = [p for p in self.rank_positions(ds.epoch, ds.seed, ds.shuffle) if p not in self.consumed]
        mine = set(worker_share(left, worker, workers, ds.batch_size).tolist())
        rng = random.Random(f"hsextract-follow:{ds.seed}:{ds.epoch}:{self.rank}:{worker}")
        live = _LiveOutput(self, window_files=ds.window_files)
        queue = _Queue(self, mine, rng if ds.shuffle else None, ds.window_files, live)
        path = self.journal / f"g{self.generation}-e{ds.epoch}-w{worker}-of-{workers}"
        with (
            open(path, "w", buffering=1) as journal,
            ThreadPoolExecutor(ds.threads, thread_name_prefix="hsextract-read") as pool,
        ):
            pending: deque = deque()
            try:
                while True:
                    while len(pending) < ds.prefetch and (nxt := queue.next()) is not None:
                        pending.append((nxt, pool.submit(live.item, *nxt)))
                    if pending:
                        (key, row), future = pending.popleft()
                        item = future.result()
                        journal.write(f"{self.starts[key] + row}\n")
                        yield item
                    elif queue.finished():
                        journal.write("end\n")
                        return
                    else:
                        live.wait()
            finally:
                for _, f in pending:
                    f.cancel()

    # -- resume -------------------------------------------------------------------------------------------------
    def state_dict(self, ds, consumed: int) -> dict:
        taken = set(self.consumed)
        if consumed:
            served, ended = _read_journals(self.journal, f"g{self.generation}-e{ds.epoch}-")
            counts = handed_out([len(s) for s in served], ended, consumed, ds.batch_size)
            for s, c in zip(served, counts, strict=True):
                taken.update(s[:c])
        mine = set(self.rank_positions(ds.epoch, ds.seed, ds.shuffle))
        by_file: dict[str, list[int] | str] = {}
        for key, b in zip(self.keys, self.manifest["batches"], strict=True):
            start = self.starts[key]
            rows = [r for r in range(len(b["sample_ids"])) if start + r in taken]
            if rows:
                rank_rows = sum(start + r in mine for r in range(len(b["sample_ids"])))
                by_file[key] = "all" if len(rows) == rank_rows else rows
        return sealed(
            {
                **self._identity(ds),
                "epoch": ds.epoch,
                "consumed": self.prior + consumed,
                "consumed_samples": by_file,
            }
        )

    def _identity(self, ds) -> dict:
        """The fields a followed state must share with the dataset that resumes it."""
        return {
            "follow": True,
            "seed": ds.seed,
            "shuffle": ds.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "plan_hash": self.manifest.get("plan_hash"),
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, ds, state: dict) -> None:
        """Every field checked (state.py); the rows of ``consumed_samples`` must be rows of their file, each once,
        and this rank's in that epoch, and as many as ``consumed`` says."""
        if not state.get("follow"):
            raise HsextractError(
                "this state was taken without follow=True: resume it with a plain StatesDataset"
            )
        mine = self._identity(ds)
        consumed: set[int] = set()

        def check_rows(by_file) -> str | None:
            if not isinstance(by_file, dict):
                return f"must be a dict batch key -> rows or 'all', got {by_file!r:.80}"
            rank = set(self.rank_positions(state["epoch"], ds.seed, ds.shuffle))
            sizes = {
                b["key"]: len(b["sample_ids"]) for b in self.manifest["batches"]
            }  # one pass, not one per key
            for key, rows in by_file.items():
                if key not in self.starts:
                    return f"names batch {key!r}, which this output's plan does not hold"
                start, n = self.starts[key], sizes[key]
                if rows == "all":
                    consumed.update(p for p in range(start, start + n) if p in rank)
                    continue
                if not isinstance(rows, list) or not all(is_int(r) for r in rows):
                    return f"{key}: must be a list of row numbers or 'all', got {rows!r:.80}"
                outside = [r for r in rows if not 0 <= r < n]
                if outside:
                    return f"{key}: rows {outside[:5]} are not rows of that file (0..{n - 1})"
                if len(set(rows)) != len(rows):
                    return f"{key}: a row is named twice"
                others = [r for r in rows if start + r not in rank]
                if others:
                    return f"{key}: rows {others[:5]} are not this rank's in epoch {state['epoch']}"
                consumed.update(start + r for r in rows)
            if len(consumed) != state["consumed"]:
                return f"names {len(consumed)} samples, but consumed is {state['consumed']}"
            return None

        fields = {
            "epoch": count(0),
            "consumed": count(0, len(self)),
            "consumed_samples": check_rows,
            **dict.fromkeys(mine, anything),
        }
        check_state(state, fields, mine, "followed StatesDataset")
        ds.epoch = state["epoch"]
        self.consumed, self.prior, self.generation = consumed, state["consumed"], self.generation + 1


def handed_out(served: list[int], ended: list[bool], consumed: int, batch_size: int) -> list[int]:
    """How many of each worker's yielded samples an in-order DataLoader has handed out after ``consumed``: batches
    of ``batch_size`` from the workers in turn, a worker that has ended skipped once its samples are all out (the
    last batch of a worker may be short). ``served``: how many each worker yielded; ``ended``: which finished."""
    counts = [0] * len(served)
    left, w = consumed, 0
    while left > 0:
        if all(e and c == s for c, s, e in zip(counts, served, ended, strict=True)):
            break
        if ended[w] and counts[w] == served[w]:
            w = (w + 1) % len(served)
            continue
        take = min(left, batch_size, served[w] - counts[w] if ended[w] else batch_size)
        counts[w] += take
        left -= take
        w = (w + 1) % len(served)
    if left or any(c > s for c, s in zip(counts, served, strict=True)):
        raise HsextractError(
            f"consumed={consumed}, but this rank's loader has served only {sum(served)} samples this iteration "
            f"(per worker: {served}): count the samples the training loop took from the loader"
        )
    return counts


# -- one process's view ---------------------------------------------------------------------------------------------
class _LiveOutput:
    """The output as this process sees it: which batches are done (their entries filled in place), and reads."""

    def __init__(self, follow: Follow, window_files: int):
        self.follow = follow
        self.where = follow.where
        self.sink = open_sink(
            self.where.path,
            self.where.endpoint_url,
            retry_deadline_s=self.where.retry_deadline_s,
            reading=True,
        )
        # Entries are filled in place as records arrive (the same values every time a process sees them), and the
        # reader's Output holds these very dicts: a file is opened only after its entry is filled.
        self.manifest = follow.manifest
        self.entries = {b["key"]: b for b in self.manifest["batches"]}
        self.admitted: set[str] = set()
        self.complete = False
        self.cache_files = window_files + 8
        self._out: Output | None = None
        self._lock = threading.Lock()
        self._polled = float("-inf")
        self._progress = time.monotonic()

    def poll(self) -> list[str]:
        """The batch keys done since the last poll, in plan order."""
        self._polled = time.monotonic()
        # The manifest before the listing: when it is there, the listing that follows holds every batch.
        complete = has_manifest(self.sink)
        if complete:
            final = read_manifest(self.sink)
            if final.get("plan_hash") != self.manifest.get("plan_hash"):
                raise HsextractError(
                    f"{self.sink.url} now holds another job (plan {final.get('plan_hash')}, this dataset followed "
                    f"{self.manifest.get('plan_hash')}): make the dataset again"
                )
            records = {b["key"]: b for b in final["batches"] if b["key"] not in self.admitted}
            if final.get("final_state"):
                self.manifest["final_state"] = final["final_state"]
        else:
            done = [k for k in done_in_output(self.sink) if k in self.entries and k not in self.admitted]
            with ThreadPoolExecutor(max(1, min(16, len(done)))) as pool:
                records = dict(zip(done, pool.map(lambda k: read_done(self.sink, k), done), strict=True))
        new = []
        for key in self.follow.keys:
            record = records.get(key)
            if record is None or not all(isinstance(record.get(f), t) for f, t in STORED_FIELDS.items()):
                continue  # no record yet, or one being replaced: the next poll sees it
            if record.get("plan_hash", self.manifest["plan_hash"]) != self.manifest["plan_hash"]:
                raise HsextractError(
                    f"{self.sink.url}: the completion record of {key} is of plan {record.get('plan_hash')}, not "
                    f"the followed {self.manifest['plan_hash']}: another job writes there"
                )
            self.entries[key].update({f: record[f] for f in STORED_FIELDS})
            new.append(key)
        self.admitted.update(new)
        if new:
            self._progress = time.monotonic()
        self.complete = complete and len(self.admitted) == len(self.entries)
        return new

    def due(self) -> bool:
        return not self.complete and time.monotonic() - self._polled >= self.follow.poll_s

    def wait(self) -> None:
        """Sleep until the next poll is due; raise if nothing new came for the timeout."""
        waited = time.monotonic() - self._progress
        if waited > self.follow.timeout_s:
            raise HsextractError(
                f"{self.sink.url}: no batch completed in the last {waited:.0f} s and no manifest yet "
                f"({len(self.admitted)} of {len(self.entries)} batches done): is the run still going? "
                "(`hsextract status RUN_DIR`); follow_timeout_s= waits longer"
            )
        time.sleep(max(0.0, self._polled + self.follow.poll_s - time.monotonic()))

    def _output(self) -> Output:
        with self._lock:
            if self._out is None:
                final = self.manifest.get("final_state")
                if final and final.get("norm") is None:  # every worker writes it before its first batch
                    final["norm"] = FinalNorm.read_meta(self.sink)
                self._out = open_where(self.where, self.manifest, cache_files=self.cache_files)
            return self._out

    def batch_file(self, key: str):
        out = self._output()
        with self._lock:  # the reader's cache of open files is not shared between threads otherwise
            return out.batch_file(key)

    def item(self, key: str, row: int) -> dict:
        s = self._output().read_sample(self.batch_file(key), row)
        schema = self.follow.schema
        return schema.item(schema.record(s), s)


class _Queue:
    """This process's samples of the admitted files: a window of files with samples left, then the files waiting."""

    def __init__(self, follow: Follow, mine: set[int], rng: random.Random | None, window_files: int, live):
        self.follow, self.mine, self.rng, self.window_files, self.live = follow, mine, rng, window_files, live
        self.window: list[tuple[str, list[int]]] = []
        self.waiting: deque = deque()

    def _admit(self) -> None:
        keys = self.live.poll()
        if self.rng is not None:
            self.rng.shuffle(keys)
        schema = self.follow.schema
        for key in keys:
            start, n = self.follow.starts[key], len(self.live.entries[key]["sample_ids"])
            rows = [r for r in range(n) if start + r in self.mine]
            if rows and type(schema).skip_reason is not Schema.skip_reason:
                f = self.live.batch_file(key)
                ids, mask, cu = f.read_all("input_ids"), f.read_all("loss_mask"), f.cu_seqlens
                rows = [
                    r for r in rows if not schema.skip_reason(ids[cu[r] : cu[r + 1]], mask[cu[r] : cu[r + 1]])
                ]
            if rows:
                self.waiting.append((key, rows))

    def next(self) -> tuple[str, int] | None:
        """The next (key, row) to read, or None while nothing admitted is left."""
        if self.live.due():
            self._admit()
        while len(self.window) < self.window_files and self.waiting:
            self.window.append(self.waiting.popleft())
        if not self.window:
            return None
        if self.rng is None:
            f = 0
        else:  # a sample drawn uniformly from the window
            k = self.rng.randrange(sum(len(rows) for _, rows in self.window))
            f = 0
            while k >= len(self.window[f][1]):
                k -= len(self.window[f][1])
                f += 1
        key, rows = self.window[f]
        row = rows.pop(self.rng.randrange(len(rows)) if self.rng else 0)
        if not rows:
            self.window.pop(f)
        return key, row

    def finished(self) -> bool:
        return self.live.complete and not self.window and not self.waiting


# -- journals and waiting -------------------------------------------------------------------------------------------
def _read_journals(root: Path, prefix: str) -> tuple[list[list[int]], list[bool]]:
    """Each worker's yielded positions and whether it finished, from the journals of one iteration (the latest
    set, should an earlier iteration of the same epoch with another worker count have left its own)."""
    paths = sorted(root.glob(f"{prefix}w*"))
    if not paths:
        return [], []
    latest = max(paths, key=lambda p: p.stat().st_mtime_ns).name.rpartition("-of-")[2]
    workers = int(latest)
    served: list[list[int]] = [[] for _ in range(workers)]
    ended = [False] * workers
    for path in paths:
        head, _, of = path.name.rpartition("-of-")
        if of != latest:
            continue
        w = int(head.rpartition("-w")[2])
        text = path.read_text()
        for line in text.split("\n")[:-1]:  # a last line without its newline is still being written
            if line == "end":
                ended[w] = True
            else:
                served[w].append(int(line))
    return served, ended


def _waiting(get, what: str, poll_s: float, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    said = False
    while (value := get()) is None:
        if time.monotonic() > deadline:
            raise HsextractError(
                f"{what} did not appear in {timeout_s:.0f} s: not an hsextract output, or its run has not "
                "prepared yet (follow_timeout_s= waits longer)"
            )
        if not said:
            log.info("waiting for %s", what)
            said = True
        time.sleep(poll_s)
    return value


def _remove_journal(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # not from a forked DataLoader worker, whose copy of the dataset dies with it
        shutil.rmtree(path, ignore_errors=True)
