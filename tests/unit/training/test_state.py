"""training/state.py: a resume state that does not fit is refused naming its field, and every public constructor of
hsextract.training checks its arguments. In-process over the shared finished run's real output; the reference for
"nothing repeated or lost" is the rank's own sequence (order.py), and the states are taken from real iterations."""

from __future__ import annotations

import copy
import json
import math

import pytest

from hsextract.errors import HsextractError
from hsextract.training import StatesDataset, StatesMapDataset, TokenBudgetBatches, index_output
from hsextract.training.state import StateError, checksum


@pytest.fixture(scope="module")
def out(written_output):
    return written_output


def taken(out, **options) -> tuple[StatesDataset, dict]:
    """A dataset on rank 0 of 2 and its state after 5 samples served without workers."""
    data = StatesDataset(out, rank=0, world_size=2, seed=3, **options)
    it = iter(data)
    for _ in range(5):
        next(it)
    return data, json.loads(json.dumps(data.state_dict()))  # as a checkpoint stores it


def edited(state: dict, **fields) -> dict:
    """The state with ``fields`` changed and its checksum made again: only the field checks can refuse it."""
    state = {**copy.deepcopy(state), **fields}
    return {**state, "checksum": checksum(state)}


def refused(data, state, field: str) -> StateError:
    with pytest.raises(StateError) as e:
        data.load_state_dict(state)
    assert e.value.field == field and f"field {field!r}" in str(e.value)
    return e.value


def test_an_untouched_state_resumes_to_exactly_the_rest(out):
    data, state = taken(out)
    resumed = StatesDataset(out, rank=0, world_size=2, seed=3)
    resumed.load_state_dict(state)
    sequence = [data.sample_ids[i] for i in data.rank_sequence()]
    assert [s["sample_id"] for s in resumed] == sequence[5:]


@pytest.mark.parametrize("epoch", [-1, 1.5, "z", True, None, "1"])
def test_an_epoch_that_is_not_a_non_negative_int_is_refused(out, epoch):
    data, state = taken(out)
    refused(StatesDataset(out, rank=0, world_size=2, seed=3), edited(state, epoch=epoch), "epoch")


@pytest.mark.parametrize("consumed", [2.5, "3", None, -1, 10**6, False])
def test_a_consumed_count_that_is_not_an_int_in_the_ranks_share_is_refused(out, consumed):
    data, state = taken(out)
    refused(StatesDataset(out, rank=0, world_size=2, seed=3), edited(state, consumed=consumed), "consumed")


@pytest.mark.parametrize("state", [None, [], [("epoch", 0)], "epoch=0", 5])
def test_a_state_that_is_not_a_dict_is_refused(out, state):
    refused(StatesDataset(out, rank=0, world_size=2, seed=3), state, "state")


def test_a_missing_or_unknown_key_is_named(out):
    data, state = taken(out)
    fresh = StatesDataset(out, rank=0, world_size=2, seed=3)
    for key in state:
        if key != "checksum":  # optional: older states have none (the test below)
            refused(fresh, {k: v for k, v in state.items() if k != key}, key)
    refused(fresh, edited(state, extra=1), "extra")


def test_identity_fields_of_another_type_are_refused(out):
    data, state = taken(out)
    fresh = StatesDataset(out, rank=0, world_size=2, seed=3)
    refused(fresh, edited(state, shuffle=1), "shuffle")  # 1 == True, but not what state_dict() wrote
    refused(fresh, edited(state, seed=3.0), "seed")
    refused(fresh, edited(state, rank=1), "rank")


def test_an_edit_that_fits_every_range_fails_the_checksum(out):
    data, state = taken(out)
    fresh = StatesDataset(out, rank=0, world_size=2, seed=3)
    error = refused(fresh, {**state, "consumed": 3}, "checksum")
    assert "edited or damaged" in str(error)
    assert fresh.state_dict(0)["consumed"] == 0  # nothing taken from the refused state


def test_a_state_without_a_checksum_resumes_on_its_field_checks(out):
    """States saved before the checksum existed: accepted when every field fits, refused by field otherwise."""
    data, state = taken(out)
    old = {k: v for k, v in state.items() if k != "checksum"}
    fresh = StatesDataset(out, rank=0, world_size=2, seed=3)
    refused(fresh, {**old, "epoch": -1}, "epoch")
    fresh.load_state_dict(old)
    assert fresh.state_dict(0)["consumed"] == state["consumed"]


def test_a_state_of_the_order_before_is_refused_naming_the_order(out):
    """States saved before the order was recorded counted samples of another epoch order (Python's shuffle): the
    same count would point elsewhere in this one, serving some samples twice and others never."""
    data, state = taken(out)
    before = {k: v for k, v in state.items() if k not in ("order", "checksum")}
    fresh = StatesDataset(out, rank=0, world_size=2, seed=3)
    for old in (before, {**before, "checksum": checksum(before)}):  # with the checksum its version wrote
        error = refused(fresh, old, "order")
        assert "another order" in str(error) and "set_epoch(epoch + 1)" in str(error)
    refused(fresh, edited(state, order="python-random"), "order")
    assert fresh.state_dict(0)["consumed"] == 0


def test_token_budget_batches_refuse_a_state_that_does_not_fit(out):
    data = StatesMapDataset(out)
    budget = max(data.lengths)
    batches = TokenBudgetBatches(data, budget, seed=1, rank=0, world_size=2)
    state = batches.state_dict(consumed=2)
    fresh = TokenBudgetBatches(data, budget, seed=1, rank=0, world_size=2)
    for epoch in ("z", -1, 1.5):
        refused(fresh, edited(state, epoch=epoch), "epoch")
    for consumed in (2.5, "3", None, len(batches) + 1):
        refused(fresh, edited(state, consumed=consumed), "consumed")
    refused(fresh, None, "state")
    refused(fresh, {k: v for k, v in state.items() if k != "max_tokens"}, "max_tokens")
    refused(fresh, {**state, "consumed": 1}, "checksum")
    fresh.load_state_dict(state)
    assert list(fresh) == batches.rank_batches()[2:]


@pytest.fixture(scope="module")
def followed_state(out):
    """A followed dataset on rank 0 of 2 after 5 samples, and its state."""
    data = StatesDataset(out, rank=0, world_size=2, seed=3, follow=True, poll_s=0.01)
    it = iter(data)
    head = [next(it)["sample_id"] for _ in range(5)]
    state = json.loads(json.dumps(data.state_dict()))
    return data, state, head


def follower(out) -> StatesDataset:
    return StatesDataset(out, rank=0, world_size=2, seed=3, follow=True, poll_s=0.01)


def test_a_followed_state_resumes_and_serves_none_of_what_it_names(out, followed_state):
    data, state, head = followed_state
    resumed = follower(out)
    resumed.load_state_dict(state)
    rest = [s["sample_id"] for s in resumed]
    assert not set(rest) & set(head) and len(head) + len(rest) == len(data)


def test_followed_rows_outside_their_file_or_not_this_ranks_are_refused(out, followed_state):
    data, state, _ = followed_state
    keys = data.follow.keys
    fresh = follower(out)
    # -1 of the second file would be the first file's last sample; 999 no sample at all.
    for rows in ([-1], [999], [1.5], "some", None):
        error = refused(
            fresh, edited(state, consumed=1, consumed_samples={keys[1]: rows}), "consumed_samples"
        )
        assert keys[1] in str(error)
    mine = set(data.follow.rank_positions(0, 3, True))
    rows_of = {
        key: [data.follow.starts[key] + r in mine for r in range(len(b["sample_ids"]))]
        for key, b in zip(keys, data.follow.manifest["batches"], strict=True)
    }
    key = next(k for k, owned in rows_of.items() if any(owned) and not all(owned))  # rows of both ranks
    theirs, own = rows_of[key].index(False), rows_of[key].index(True)
    error = refused(fresh, edited(state, consumed=1, consumed_samples={key: [theirs]}), "consumed_samples")
    assert "not this rank's" in str(error)
    refused(fresh, edited(state, consumed=2, consumed_samples={key: [own, own]}), "consumed_samples")
    refused(fresh, edited(state, consumed=2, consumed_samples={key: [own]}), "consumed_samples")
    refused(
        fresh, edited(state, consumed_samples={"shard-99999/none.safetensors": "all"}), "consumed_samples"
    )
    refused(fresh, edited(state, consumed_samples=[keys[0]]), "consumed_samples")
    refused(fresh, edited(state, epoch=-1), "epoch")
    refused(fresh, {**state, "consumed_samples": {}}, "consumed_samples")  # 0 named, 5 consumed


BAD_NUMBERS = [math.nan, math.inf, -1.0, 0, "5", None]


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize("name", ["cache_max_gb", "poll_s", "follow_timeout_s"])
def test_statesdataset_refuses_a_bad_number_by_name(out, tmp_path, name, value):
    with pytest.raises(HsextractError, match=name):
        StatesDataset(out, cache_dir=str(tmp_path / "cache"), **{name: value})


@pytest.mark.timeout(60)
def test_a_nan_follow_timeout_is_refused_not_waited_on(tmp_path):
    """Was: waited forever on a directory with no output."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(HsextractError, match="follow_timeout_s must be a positive, finite number"):
        StatesDataset(tmp_path / "empty", follow=True, follow_timeout_s=math.nan, poll_s=0.01)
    with pytest.raises(HsextractError, match="poll_s must be a positive, finite number"):
        StatesDataset(tmp_path / "empty", follow=True, poll_s=math.nan)


@pytest.mark.parametrize(
    "options, name",
    [
        ({"batch_size": 1.5}, "batch_size"),
        ({"batch_size": "2"}, "batch_size"),
        ({"window_files": 0}, "window_files"),
        ({"threads": True}, "threads"),
        ({"prefetch": math.nan}, "prefetch"),
        ({"seed": 1.5}, "seed"),
        ({"shuffle": "yes"}, "shuffle"),
        ({"follow": 1}, "follow"),
        ({"rank": "0", "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0.5}, "world_size"),
        ({"verify": "no"}, "verify"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"endpoint_url": 5}, "endpoint_url"),
        ({"cache_dir": 5}, "cache_dir"),
    ],
)
def test_statesdataset_refuses_a_bad_argument_by_name(out, options, name):
    with pytest.raises(HsextractError, match=name):
        StatesDataset(out, **options)


@pytest.mark.parametrize(
    "options, name",
    [
        ({"cache_max_gb": math.inf}, "cache_max_gb"),
        ({"verify": None}, "verify"),
        ({"dtype": float}, "dtype"),
    ],
)
def test_statesmapdataset_refuses_a_bad_argument_by_name(out, options, name):
    with pytest.raises(HsextractError, match=name):
        StatesMapDataset(out, **options)


@pytest.mark.parametrize(
    "options, name",
    [
        ({"max_tokens": math.nan}, "max_tokens"),
        ({"max_tokens": 10**9, "seed": "1"}, "seed"),
        ({"max_tokens": 10**9, "shuffle": None}, "shuffle"),
        ({"max_tokens": 10**9, "window_files": 2.5}, "window_files"),
        ({"max_tokens": 10**9, "max_samples": 0}, "max_samples"),
    ],
)
def test_token_budget_batches_refuse_a_bad_argument_by_name(out, options, name):
    with pytest.raises(HsextractError, match=name):
        TokenBudgetBatches(StatesMapDataset(out), **options)


def test_set_epoch_takes_only_a_non_negative_int(out):
    data = StatesDataset(out)
    for epoch in (-1, 1.5, "z"):
        with pytest.raises(HsextractError, match="epoch"):
            data.set_epoch(epoch)


@pytest.mark.parametrize(
    "options, name",
    [
        ({"cache_max_gb": math.nan, "cache_dir": "c"}, "cache_max_gb"),
        ({"retry_deadline_s": math.inf}, "retry_deadline_s"),
        ({"verify": 0}, "verify"),
        ({"dtype": "float32"}, "dtype"),
    ],
)
def test_index_output_refuses_a_bad_argument_by_name(out, options, name):
    with pytest.raises(HsextractError, match=name):
        index_output(out, **options)
