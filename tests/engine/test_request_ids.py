"""RequestIds: the one request-id uniqueness check (exact ids, all-or-nothing batches)."""

from __future__ import annotations

import pytest

from jaxllm.engine.request_ids import RequestIds, child_request_ids


def test_child_ids_are_the_parent_id_alone_or_indexed():
    assert child_request_ids("x", 1) == ["x"]
    assert child_request_ids("x", 3) == ["0_x", "1_x", "2_x"]


def test_a_child_id_collides_with_a_parent_in_flight_both_ways():
    ids = RequestIds()
    assert ids.reserve([("0_x", 1)]) == ["0_x"]
    with pytest.raises(ValueError, match=r"request_id 'x' with n=2 runs its samples as '0_x'"):
        ids.reserve([("x", 2)])
    assert "x" not in ids and "1_x" not in ids  # nothing of the refused request was taken
    ids.release("0_x")
    assert ids.reserve([("x", 2)]) == ["x"]
    assert {"x", "0_x", "1_x"} <= set(ids._taken)
    with pytest.raises(ValueError, match="'1_x' is already in flight"):
        ids.reserve([("1_x", 1)])
    with pytest.raises(ValueError, match="'x' is already in flight"):
        ids.reserve([("x", 1)])
    ids.release("x")
    assert len(ids) == 0 and not ids._taken


def test_a_batch_is_all_or_nothing_and_checked_against_itself():
    ids = RequestIds()
    ids.reserve([("live", 1)])
    with pytest.raises(ValueError, match="'dup' is already in flight"):
        ids.reserve([("dup", 1), ("dup", 1)])
    with pytest.raises(ValueError, match="'live' is already in flight"):
        ids.reserve([("fresh", 1), ("live", 1)])
    with pytest.raises(ValueError, match="runs its samples as '0_y'"):
        ids.reserve([("0_y", 1), ("y", 2)])
    assert set(ids._taken) == {"live"} and len(ids) == 1


def test_drawn_ids_skip_every_id_in_use():
    ids = RequestIds()
    ids.reserve([("1", 1), ("0_2", 1)])
    # "0" is free; "1" is taken; "2" with n=2 would run as 0_2 (taken); "3" is free.
    assert ids.reserve([(None, 1), (None, 2), (None, 1)]) == ["0", "3", "4"]
    assert {"0_3", "1_3"} <= set(ids._taken)
    ids.release("0_2")
    assert ids.reserve([(None, 2)]) == ["5"]  # drawn ids never go back


def test_releasing_an_unknown_id_changes_nothing():
    ids = RequestIds()
    ids.reserve([("a", 2)])
    ids.release("0_a")  # a child id is not a parent: the parent keeps all its ids
    ids.release("nope")
    assert set(ids._taken) == {"a", "0_a", "1_a"}


@pytest.mark.parametrize("bad", [3, b"x", ("x",)])
def test_a_request_id_must_be_a_string(bad):
    with pytest.raises(ValueError, match="request_id must be a str, got"):
        RequestIds().reserve([(bad, 1)])
