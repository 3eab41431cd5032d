"""A multi-node job prepares once: node 0 tokenizes, plans and publishes its token file in the output; every other
node takes that file instead of tokenizing the whole dataset, and plans from it.

Node 0 beats a lease while it prepares (timed by the waiter's own clock); the record, written last, names what was
prepared, so a node takes only its own job's file, checks it and its plan hash, and never a half-published one.
Node 0 rather than the first claimant, so no takeover protocol is needed. docs/SCALING.md has the files and waits.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from hsextract.errors import HsextractError
from hsextract.prepare.plan import fingerprint_changes
from hsextract.prepare.sources import changed_files
from hsextract.prepare.tokenize import cache_file
from hsextract.storage import open_sink
from hsextract.storage.base import read_with_crc32
from hsextract.storage.fileio import tmp_path

log = logging.getLogger(__name__)

PREFIX = "hsextract/prepare/"
LEASE = PREFIX + "lease.json"
TOKENS = PREFIX + "tokens.safetensors"
RECORD = PREFIX + "prepared.json"


BEAT_S = 10.0

"""How often the preparing node rewrites its lease."""


LEASE_STALE_S = 120.0

"""A lease whose beat has not moved for this long belongs to a node that died (a dozen missed beats: an S3 write
retried for a minute does not count as death)."""


POLL_S = 2.0

"""How often a waiting node reads the record and the lease."""


REPORT_EVERY_S = 30.0

"""How often a waiting node says what it waits for."""


def prepare_once(cfg, run_dir, mix, tokenizer, fingerprint: dict, restart: bool, echo=print):
    """This node's part in preparing the job once: a ``with`` block around tokenizing and planning. On one node
    there is nothing to share."""
    if cfg.nodes == 1:
        return Alone()
    cache_path = cache_file(
        run_dir.cache_dir,
        mix,
        tokenizer,
        max_length=cfg.max_length,
        too_long=cfg.too_long,
        dedupe=cfg.dedupe,
    )
    return PreparedOnce(
        open_sink(cfg.output, cfg.s3_endpoint_url),
        {"fingerprint": fingerprint, "shards": cfg.total_shards, "tokens": cache_path.name},
        mix.describe(),
        cache_path,
        rank=cfg.node_rank,
        wait_s=cfg.prepare_wait_s,
        restart=restart,
        echo=echo,
    )


class Alone:
    """A single-node job: it prepares for itself."""

    def __enter__(self) -> Alone:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def check_plan(self, plan) -> None:
        pass

    def publish(self, plan) -> None:
        pass


class PreparedOnce:
    """One node's side of a preparation shared through the output: node 0 leads (lease, then publish), the others
    take. ``identity``: what must be equal for a node to take another's tokens; ``sources``: ``Mix.describe()``,
    whose changed files a refusal names; ``cache_path``: where this node's token cache keeps these tokens."""

    def __init__(
        self,
        sink,
        identity: dict,
        sources: list[dict],
        cache_path: Path,
        *,
        rank: int,
        wait_s: float,
        restart: bool = False,
        echo=print,
        beat_s: float = BEAT_S,
        stale_s: float = LEASE_STALE_S,
        poll_s: float = POLL_S,
        report_s: float = REPORT_EVERY_S,
    ) -> None:
        self.sink, self.identity, self.sources, self.cache_path = sink, identity, sources, Path(cache_path)
        self.rank, self.wait_s, self.restart, self.echo = rank, wait_s, restart, echo
        self.beat_s, self.stale_s, self.poll_s, self.report_s = beat_s, stale_s, poll_s, report_s
        self.taken: dict | None = None
        """The record whose plan hash this node's plan must have (node 0's, taken or already in the cache)."""
        self.leading = False
        self.attempt = uuid.uuid4().hex
        self._beat = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seen_at_start: set[str] = set()
        self._lease_at_start: tuple | None = None
        self._mismatched: set[str] = set()

    # -- entering: take, lead, or wait and take ------------------------------------------------------------------
    def __enter__(self) -> PreparedOnce:
        record, lease = self._read(RECORD), self._read(LEASE)
        # What is in the output before this node starts may be an earlier attempt's (a dead or failed node 0, whose
        # rerun may still be starting) or an earlier job's (which --restart replaces).
        self._seen_at_start = {r.get("attempt") for r in (record, lease) if r}
        self._lease_at_start = _beat_key(lease)
        if self._mine(record):
            self.taken = record
            if self.cache_path.exists():
                if self.rank != 0 or self._published_intact(record):
                    return self
            elif self._take(record):
                return self
        else:
            self._refuse_other_job(lease or record)
        if self.rank == 0:  # node 0 prepares, and publishes again what the output lacks
            self.taken = None
            self._lead()
        elif not self.cache_path.exists():
            self._wait_and_take()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.leading and not self._stop.is_set():
            if exc is None:
                error = "stopped before publishing"
            else:
                error = str(exc) if isinstance(exc, HsextractError) else f"{exc_type.__name__}: {exc}"
            try:
                self._end_lease("failed", error)
            except Exception as e:  # the waiting nodes then see the lease go stale
                log.warning("could not record the failed preparation in %s: %s", self.sink.url, e)

    def _mine(self, record: dict | None) -> bool:
        return record is not None and record.get("identity") == self.identity

    def _refuse_other_job(self, theirs: dict | None) -> None:
        """``theirs`` (the newest lease or record) prepares another job: refused, unless it was there before this
        node started and ``--restart`` replaces it."""
        if theirs is None or theirs.get("identity") == self.identity:
            return
        if self.restart and theirs.get("attempt") in self._seen_at_start:
            return
        other = theirs.get("identity") or {}
        changes = fingerprint_changes(other.get("fingerprint") or {}, self.identity["fingerprint"])
        changes += changed_files(theirs.get("sources") or [], self.sources)
        if other.get("shards") != self.identity["shards"]:
            changes.append(
                f"shards: {other.get('shards')} -> {self.identity['shards']} (nodes x shards per node)"
            )
        if not changes:
            changes.append(
                f"token file: {other.get('tokens')} -> {self.identity['tokens']} (hsextract versions?)"
            )
        raise HsextractError(
            f"output {self.sink.url} holds node 0's preparation of another job ({_who(theirs)}): this node was "
            "started with other data or options, so node 0's tokens are not its own. What differs (node 0 -> "
            "this node):\n  " + "\n  ".join(changes) + "\nStart every node with the same command, or choose "
            "another --output (after changing the job's options, rerun every node with --restart)."
        )

    def _take(self, record: dict) -> bool:
        """Download the published token file into the token cache; False if it is not the one ``record`` names
        (replaced or removed since the record was read)."""
        t0 = time.monotonic()
        want = record["tokens_file"]
        part = tmp_path(self.cache_path)
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.sink.get_file(want["key"], part)
            size, crc = read_with_crc32(part)
            if (size, f"{crc:08x}") != (want["size"], want["crc32"]):
                what = (
                    f"{self.sink.url}/{want['key']} has {size} bytes, CRC32 {crc:08x}; its record "
                    f"{self.sink.url}/{RECORD} says {want['size']} bytes, CRC32 {want['crc32']}"
                )
                if record.get("attempt") in self._mismatched:  # the same record twice: not a replacement
                    raise HsextractError(
                        f"{what}: the published token file is damaged. Rerun node 0's command: it publishes "
                        "it again; then rerun this node's."
                    )
                self._mismatched.add(record.get("attempt"))
                log.warning("%s: reading the record again", what)
                return False
            os.replace(part, self.cache_path)
        except FileNotFoundError:
            return False
        finally:
            part.unlink(missing_ok=True)
        self.taken = record
        self.echo(
            f"took the tokens node 0 published ({_who(record)}): {self.sink.url}/{want['key']}, "
            f"{want['size'] / 1e6:,.1f} MB, CRC32 {want['crc32']} checked, in {time.monotonic() - t0:.1f} s"
        )
        return True

    def _published_intact(self, record: dict) -> bool:
        """The token file the record names is in the output, of its size (and CRC32 where the store keeps one)."""
        want = record["tokens_file"]
        stored = self.sink.checksum(want["key"])
        return (
            stored is not None
            and stored.size == want["size"]
            and (stored.crc32 is None or f"{stored.crc32:08x}" == want["crc32"])
        )

    def _wait_and_take(self) -> None:
        """Wait for node 0's record (never past ``wait_s``, saying every ``report_s`` what for), then take it."""
        start = last_report = time.monotonic()
        beat, beat_since = None, start
        self.echo(f"waiting for node 0 to publish the prepared tokens and plan at {self.sink.url}/{PREFIX}")
        while True:
            record, lease = self._read(RECORD), self._read(LEASE)
            if self._mine(record) and self._take(record):
                return
            now = time.monotonic()
            if not self._mine(record):
                self._refuse_other_job(lease or record)
            mine = lease if lease is not None and lease.get("identity") == self.identity else None
            key = _beat_key(mine)
            if key != beat:
                beat, beat_since = key, now
            # Only a lease seen to change while this node waits can go stale: one unchanged since before it started
            # may be a dead attempt whose rerun is still in its checks (then the time limit decides).
            if mine is not None and key != self._lease_at_start:
                if mine.get("state") == "failed":
                    raise HsextractError(
                        f"node 0 failed to prepare the job ({_who(mine)}): {mine.get('error')}\nThis node has "
                        "nothing to run without it: fix what node 0 says, then rerun every node's command."
                    )
                if now - beat_since > self.stale_s:
                    raise HsextractError(
                        f"node 0 stopped preparing ({_who(mine)}): its lease at {self.sink.url}/{LEASE} has not "
                        f"changed for {now - beat_since:.0f} s (a live node renews it every "
                        f"{mine.get('beat_s', BEAT_S):.0f} s), so it died mid-preparation. Nothing it left "
                        "unfinished is used: rerun every node's command (the same commands) to prepare the job "
                        "again."
                    )
            if now - start > self.wait_s:
                raise HsextractError(
                    f"node 0 did not publish the prepared tokens and plan at {self.sink.url}/{PREFIX} within "
                    f"--prepare-wait {self.wait_s:.0f} s ({self._state(mine, now - beat_since)}). See node 0's "
                    "output: if it stopped, rerun every node's command; if it is only slow, rerun this node's with "
                    "a larger --prepare-wait."
                )
            if now - last_report >= self.report_s:
                last_report = now
                self.echo(
                    f"still waiting for node 0's prepared tokens and plan at {self.sink.url}/{PREFIX}: "
                    f"{self._state(mine, now - beat_since)}; {self.wait_s - (now - start):.0f} s left of "
                    "--prepare-wait"
                )
            time.sleep(self.poll_s)

    def _state(self, lease: dict | None, still_s: float) -> str:
        if lease is None:
            return "node 0 has not started preparing"
        if _beat_key(lease) == self._lease_at_start:
            said = f": {lease.get('error')}" if lease.get("state") == "failed" else ""
            return (
                f"node 0's lease says {lease.get('state')}{said} ({_who(lease)}), unchanged since before this "
                "node started: if node 0 is not running, start it"
            )
        if lease.get("state") == "preparing":
            return f"node 0 is preparing ({_who(lease)}), its lease renewed {still_s:.0f} s ago"
        return f"node 0's lease says {lease.get('state')} ({_who(lease)}), {still_s:.0f} s ago"

    # -- leading: the lease, then the publication ----------------------------------------------------------------
    def _lead(self) -> None:
        self.leading = True
        self._write_lease("preparing")
        threading.Thread(target=self._beats, name="prepare-lease", daemon=True).start()

    def _beats(self) -> None:
        while not self._stop.wait(self.beat_s):
            with self._lock:
                if self._stop.is_set():
                    return
                self._beat += 1
                try:
                    self._write_lease("preparing")
                except Exception as e:  # the next beat tries again; waiting nodes allow a dozen missed ones
                    log.warning("could not renew the preparation lease in %s: %s", self.sink.url, e)

    def _end_lease(self, state: str, error: str | None = None) -> None:
        with self._lock:
            self._stop.set()
            self._write_lease(state, error)

    def _write_lease(self, state: str, error: str | None = None) -> None:
        lease = {
            "attempt": self.attempt,
            "state": state,
            "beat": self._beat,
            "beat_s": self.beat_s,
            **_by(self.rank),
            "identity": self.identity,
            "sources": self.sources,
            **({"error": error} if error else {}),
        }
        self.sink.put_bytes(LEASE, json.dumps(lease, indent=2).encode())

    def check_plan(self, plan) -> None:
        """A plan made from tokens taken from node 0 must be node 0's plan."""
        if self.taken is not None and plan.plan_hash != self.taken.get("plan_hash"):
            raise HsextractError(
                f"the plan made here from node 0's tokens has hash {plan.plan_hash}, node 0's has "
                f"{self.taken.get('plan_hash')} ({_who(self.taken)}): the nodes plan differently (another "
                "hsextract version?). Install the same hsextract on every node and rerun every node's command."
            )

    def publish(self, plan) -> None:
        """Node 0, leading, once its plan holds the output's claim: the token file, then the record naming it."""
        if not self.leading:
            return
        t0 = time.monotonic()
        self.sink.delete(RECORD)  # no record names the token file while it is replaced
        size, crc = read_with_crc32(self.cache_path)
        stored = self.sink.put_file(self.cache_path, TOKENS, expected_crc32=crc)
        record = {
            "attempt": self.attempt,
            "identity": self.identity,
            "sources": self.sources,
            "plan_hash": plan.plan_hash,
            "tokens_file": {"key": TOKENS, "size": stored.size, "crc32": f"{crc:08x}"},
            **_by(self.rank),
        }
        self.sink.put_bytes(RECORD, json.dumps(record, indent=2).encode())
        self._end_lease("published")
        self.echo(
            f"published the tokens ({size / 1e6:,.1f} MB) and plan for the other nodes at "
            f"{self.sink.url}/{PREFIX} in {time.monotonic() - t0:.1f} s"
        )

    def _read(self, key: str) -> dict | None:
        try:
            value = json.loads(self.sink.get_bytes(key))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # written whole or not at all: unreadable only by hand, and then not ours to trust
        return value if isinstance(value, dict) else None


def _beat_key(lease: dict | None) -> tuple | None:
    """What changes each time a preparing node renews its lease."""
    return None if lease is None else (lease.get("attempt"), lease.get("beat"), lease.get("state"))


def _by(rank: int) -> dict:
    return {"node_rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


def _who(doc: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(doc.get("time", 0)))
    return f"host {doc.get('host')}, pid {doc.get('pid')}, {when}"
