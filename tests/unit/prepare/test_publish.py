"""One node prepares, the others take (prepare/publish.py): two "nodes" in one process over a real local output,
with real token files; the waiting node runs in a thread, as it would wait beside node 0 in another process."""

import threading
import time

import numpy as np
import pytest

from hsextract.config import RunConfig
from hsextract.errors import HsextractError
from hsextract.prepare.plan import make_plan
from hsextract.prepare.publish import LEASE, RECORD, TOKENS, PreparedOnce
from hsextract.prepare.tokenfile import TokenFileWriter, TokenizedSamples
from hsextract.storage.base import MiB
from hsextract.storage.local import LocalSink
from hsextract.storage.s3 import S3Sink

FINGERPRINT = {"data": "abc123", "layer_ids": [0, 3, 7], "max_length": 300}
SOURCES = [{"name": "chat", "source": "data.jsonl", "kind": "jsonl", "options": {}, "identity": {}}]


def identity(**changes) -> dict:
    return {"fingerprint": {**FINGERPRINT, **changes}, "shards": 4, "tokens": "tokens-0123.safetensors"}


def write_tokens(path, n=40, seed=0, longest=60) -> TokenizedSamples:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest, n)
    with TokenFileWriter(path) as writer:
        writer.add_block(
            [f"row-{i}" for i in range(n)],
            lengths,
            rng.integers(0, 1000, int(lengths.sum())),
            rng.integers(0, 2, int(lengths.sum())),
        )
        return writer.finish({"data_report": "{}"})


def plan_of(samples: TokenizedSamples, fingerprint=FINGERPRINT):
    return make_plan(
        samples.lengths.tolist(), max_tokens_per_batch=300, max_rows=8, shards=4, fingerprint=fingerprint
    )


def node(sink, root, rank, ident=None, **options) -> PreparedOnce:
    options = {"wait_s": 30.0, "poll_s": 0.02, **options}
    cache = root / f"node{rank}" / "cache" / "tokens-0123.safetensors"
    return PreparedOnce(sink, ident or identity(), SOURCES, cache, rank=rank, **options)


class Waiting:
    """A node entering (waiting, then taking) in a thread; ``join`` gives what it raised, if anything."""

    def __init__(self, prepared: PreparedOnce):
        self.prepared, self.error, self.lines = prepared, None, []
        prepared.echo = self.lines.append
        self.thread = threading.Thread(target=self._enter, daemon=True)
        self.thread.start()

    def _enter(self):
        try:
            with self.prepared:
                pass
        except HsextractError as e:
            self.error = e

    def until_waiting(self, timeout=20):
        deadline = time.monotonic() + timeout
        while not any(line.startswith("waiting for node 0") for line in self.lines):
            assert self.thread.is_alive() and time.monotonic() < deadline, (self.error, self.lines)
            time.sleep(0.01)
        return self

    def join(self, timeout=20):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the waiting node is still waiting"
        return self.error


def test_node_1_waits_for_node_0_and_takes_its_tokens_and_plan(tmp_path):
    sink = LocalSink(tmp_path / "out")
    node1 = Waiting(node(sink, tmp_path, 1)).until_waiting()
    time.sleep(0.2)
    assert node1.thread.is_alive() and not node1.prepared.cache_path.exists()
    node0 = node(sink, tmp_path, 0)
    with node0:
        samples = write_tokens(node0.cache_path)
        plan = plan_of(samples)
        node0.check_plan(plan)
        assert sink.exists(LEASE) and not sink.exists(RECORD)
        node0.publish(plan)
    assert node1.join() is None
    assert node1.prepared.cache_path.read_bytes() == node0.cache_path.read_bytes()
    assert any("took the tokens node 0 published" in line for line in node1.lines), node1.lines
    taken = TokenizedSamples.load(node1.prepared.cache_path)
    node1.prepared.check_plan(plan_of(taken))  # the same plan, by its hash
    other = make_plan(
        taken.lengths.tolist(), max_tokens_per_batch=300, max_rows=4, shards=4, fingerprint=FINGERPRINT
    )
    with pytest.raises(HsextractError, match="the plan made here from node 0's tokens has hash"):
        node1.prepared.check_plan(other)


def test_a_node_started_with_other_options_is_refused_naming_them(tmp_path):
    sink = LocalSink(tmp_path / "out")
    node0 = node(sink, tmp_path, 0)
    with node0:
        # While node 0 prepares, and once it has published.
        with pytest.raises(HsextractError, match=r"layer_ids: \[0, 3, 7\] -> \[1, 3, 7\]"):
            with node(sink, tmp_path, 1, identity(layer_ids=[1, 3, 7])):
                pass
        node0.publish(plan_of(write_tokens(node0.cache_path)))
    stranger = node(sink, tmp_path, 1, {**identity(), "shards": 6})
    with pytest.raises(HsextractError, match=r"another job(.|\n)*shards: 4 -> 6"):
        with stranger:
            pass
    assert not stranger.cache_path.exists(), "a refused node took the tokens"


def test_a_waiting_node_gives_up_at_its_time_limit_saying_what_and_where(tmp_path):
    sink = LocalSink(tmp_path / "out")
    waiting = Waiting(node(sink, tmp_path, 1, wait_s=0.5, report_s=0.2))
    error = waiting.join()
    assert error is not None
    assert f"did not publish the prepared tokens and plan at {sink.url}/hsextract/prepare/" in str(error)
    assert "--prepare-wait 0 s (node 0 has not started preparing)" in str(error)
    assert "rerun every node's command" in str(error)
    reports = [line for line in waiting.lines if line.startswith("still waiting")]
    assert reports and "s left of --prepare-wait" in reports[0], waiting.lines


def test_a_preparer_whose_lease_stops_beating_is_named_before_the_time_limit(tmp_path):
    sink = LocalSink(tmp_path / "out")
    waiting = Waiting(node(sink, tmp_path, 1, stale_s=0.5, wait_s=60)).until_waiting()
    start = time.monotonic()
    node0 = node(sink, tmp_path, 0, beat_s=3600)  # leads, then never beats: a dead node, as seen from outside
    with node0:
        error = waiting.join()
        assert time.monotonic() - start < 10
        node0.publish(plan_of(write_tokens(node0.cache_path)))  # (only to end it)
    assert error is not None and "node 0 stopped preparing" in str(error), error
    assert "died mid-preparation" in str(error) and "rerun every node's command" in str(error)


def test_a_lease_left_by_a_dead_or_failed_attempt_waits_for_node_0s_rerun(tmp_path):
    """A whole-job rerun: node 1 starts while the output holds the last attempt's lease (dead, or failed), and node
    0's rerun is still in its checks for longer than a lease takes to go stale."""
    sink = LocalSink(tmp_path / "out")
    with pytest.raises(HsextractError), node(sink, tmp_path, 0):
        raise HsextractError("source chat: no row survives")
    assert b'"failed"' in sink.get_bytes(LEASE)
    waiting = Waiting(node(sink, tmp_path, 1, stale_s=0.2, report_s=0.1)).until_waiting()
    time.sleep(1.0)
    assert waiting.thread.is_alive(), waiting.error
    said = [line for line in waiting.lines if line.startswith("still waiting")]
    assert "no row survives" in said[-1] and "unchanged since before this node started" in said[-1], said
    node0 = node(sink, tmp_path, 0)
    with node0:
        node0.publish(plan_of(write_tokens(node0.cache_path)))
    assert waiting.join() is None and waiting.prepared.taken is not None


@pytest.mark.slow  # 4-5 s: the fast tier's budget (60 s on 2 cores)
def test_a_beating_preparer_is_waited_for(tmp_path):
    sink = LocalSink(tmp_path / "out")
    node0 = node(sink, tmp_path, 0, beat_s=0.1)
    with node0:
        # 30 beats to the stale period: with 10, a loaded CI machine (three test files on two cores) held a beat
        # back for longer than 1 s and the waiter took the live preparer for a dead one.
        waiting = Waiting(node(sink, tmp_path, 1, stale_s=3.0)).until_waiting()
        time.sleep(4.0)  # longer than the stale period
        assert waiting.thread.is_alive(), (waiting.error, waiting.lines)
        node0.publish(plan_of(write_tokens(node0.cache_path)))
    assert waiting.join() is None


def test_node_0s_failure_ends_the_wait_with_its_message(tmp_path):
    sink = LocalSink(tmp_path / "out")
    node0 = node(sink, tmp_path, 0)
    waiting = Waiting(node(sink, tmp_path, 1)).until_waiting()
    with pytest.raises(HsextractError), node0:
        raise HsextractError("source chat: no row survives")
    error = waiting.join()
    assert error is not None and "node 0 failed to prepare the job" in str(error)
    assert "no row survives" in str(error)


def test_nothing_half_published_is_taken(tmp_path):
    """Node 0 died after uploading the token file, before the record: the token file is never taken."""
    sink = LocalSink(tmp_path / "out")
    node0 = node(sink, tmp_path, 0, beat_s=3600)
    with node0:
        samples = write_tokens(node0.cache_path)
        sink.put_file(node0.cache_path, TOKENS)
        waiting = Waiting(node(sink, tmp_path, 1, wait_s=0.5))
        assert waiting.join() is not None
        assert not waiting.prepared.cache_path.exists()
        node0.publish(plan_of(samples))


def test_a_damaged_published_token_file_is_refused_and_node_0_publishes_it_again(tmp_path):
    sink = LocalSink(tmp_path / "out")
    node0 = node(sink, tmp_path, 0)
    with node0:
        node0.publish(plan_of(write_tokens(node0.cache_path)))
    good = node0.cache_path.read_bytes()
    sink.put_bytes(TOKENS, good[:-100])
    with pytest.raises(HsextractError, match="the published token file is damaged. Rerun node 0's command"):
        with node(sink, tmp_path, 1):
            pass
    # Node 0's rerun finds the published file short of its record and publishes it again.
    again = node(sink, tmp_path, 0)
    with again:
        assert again.leading
        again.publish(plan_of(TokenizedSamples.load(again.cache_path)))
    assert sink.get_bytes(TOKENS) == good
    with node(sink, tmp_path, 1) as node1:
        assert node1.cache_path.read_bytes() == good


def test_restart_waits_for_the_new_preparation_instead_of_refusing_the_old_one(tmp_path):
    sink = LocalSink(tmp_path / "out")
    old = node(sink, tmp_path, 0)
    with old:
        old.publish(plan_of(write_tokens(old.cache_path)))
    new_identity = identity(max_length=200)
    waiting = Waiting(node(sink, tmp_path, 1, new_identity, restart=True)).until_waiting()
    node0 = node(sink, tmp_path, 0, new_identity, restart=True)
    node0.cache_path.unlink()
    with node0:
        node0.publish(plan_of(write_tokens(node0.cache_path, seed=1), {**FINGERPRINT, "max_length": 200}))
    assert waiting.join() is None
    assert waiting.prepared.cache_path.read_bytes() == node0.cache_path.read_bytes()


def test_prepare_wait_must_be_a_positive_number_of_seconds(tmp_path):
    base = {"model": "m", "data": "d.jsonl", "output": "o", "run_dir": str(tmp_path), "device": "cpu"}
    assert RunConfig(**base).prepare_wait_s == 3600
    for bad in (0, -5, float("inf")):
        with pytest.raises(HsextractError, match="--prepare-wait must be a positive number of seconds"):
            RunConfig(**base, prepare_wait_s=bad)


@pytest.mark.slow  # 2-3 s: the fast tier's budget (60 s on 2 cores)
@pytest.mark.usefixtures("aws_test_env")
def test_a_multipart_token_file_goes_through_s3_and_comes_back_checked(tmp_path, s3, s3_bucket):
    sink = S3Sink(s3_bucket, "job", s3.url, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    node0 = node(sink, tmp_path, 0)
    with node0:
        samples = write_tokens(node0.cache_path, n=20_000, seed=2, longest=250)
        assert node0.cache_path.stat().st_size > 10 * MiB
        node0.publish(plan_of(samples))
    head = s3.client().head_object(Bucket=s3_bucket, Key=f"job/{TOKENS}")
    assert head["ETag"].rstrip('"').split("-")[-1] == "3", "uploaded in 5 MiB parts"
    with node(sink, tmp_path, 1) as node1:
        assert node1.taken is not None
    assert node1.cache_path.read_bytes() == node0.cache_path.read_bytes()
