"""DPRouter: prefix-cache affinity, then the shortest queue (exact replica choices)."""

from __future__ import annotations

import pytest

from jaxllm.engine.dp_router import DPRouter

BS = 4  # block size


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    """Full blocks of token `b` each (so equal leading arguments share a prefix), then
    `tail` extra tokens (a partial block, never hashed)."""
    return [t for b in blocks for t in [b] * BS] + [999] * tail


def router(n=2, imbalance=2, capacity=100, **kwargs) -> DPRouter:
    return DPRouter(n, BS, max_imbalance=imbalance, capacity=capacity, **kwargs)


def test_without_a_known_prefix_the_least_loaded_replica_wins_lowest_first():
    r = router(n=3)
    assert [r.route(prompt(b)) for b in (1, 2, 3, 4)] == [0, 1, 2, 0]
    r.finished(1)
    assert r.route(prompt(5)) == 1
    assert r.load == [2, 1, 1] and r.routed == [2, 2, 1]


def test_a_shared_prefix_follows_the_replica_that_computed_it():
    r = router()
    assert r.route(prompt(1, 2)) == 0
    assert r.route(prompt(7)) == 1
    assert r.route(prompt(1, 2, 3, tail=2)) == 0  # its first two blocks are on replica 0
    assert r.route(prompt(7, 8)) == 1
    assert r.route(prompt(1, 9)) == 0  # only block 1 is shared: still replica 0
    assert r.load == [3, 2]


def test_the_longest_known_prefix_decides():
    r = router(imbalance=1)
    assert r.route(prompt(1, 2, 3)) == 0  # [1], [1 2], [1 2 3] -> 0
    assert r.route(prompt(1)) == 0
    assert r.route(prompt(1, 2)) == 1  # replica 0 is 2 ahead: [1], [1 2] -> 1
    assert r.load == [2, 1]
    assert r.route(prompt(1, 2, 3, 4)) == 0  # [1 2 3] is still recorded on replica 0
    assert r.route(prompt(1, 2, 5)) == 1  # its longest known prefix, [1 2], is on 1


def test_affinity_gives_way_beyond_the_imbalance():
    r = router(imbalance=2)
    for _ in range(3):  # the same prompt three times: all on replica 0 (0, 1, 2 ahead)
        assert r.route(prompt(1, 2)) == 0
    assert r.load == [3, 0]
    assert r.route(prompt(1, 2)) == 1  # 3 more than replica 1 > 2: the shortest queue
    assert r.route(prompt(1, 2)) == 1  # and replica 1 has now computed it last
    r.finished(0), r.finished(0), r.finished(0)
    assert r.route(prompt(1, 2)) == 1


def test_the_record_forgets_the_least_recently_used_prefixes():
    r = router(capacity=2)
    r.route(prompt(1))  # replica 0: [1]
    r.route(prompt(2))  # replica 1: [2]
    r.route(prompt(3))  # replica 0: [3]; [1] is forgotten
    assert r.load == [2, 1]
    assert r.route(prompt(1)) == 1  # no record: the least loaded
    assert r.route(prompt(3)) == 0  # load 2 vs 2: the record of [3] holds


def test_forget_drops_one_replicas_prefixes():
    r = router()
    r.route(prompt(1)), r.route(prompt(2))
    r.forget(0)
    r.load = [0, 1]
    assert r.route(prompt(2)) == 1  # still recorded on 1 (within the imbalance)
    r.load = [1, 0]
    assert r.route(prompt(1)) == 1  # replica 0 no longer holds it: the least loaded


def test_without_prefix_caching_only_the_load_counts():
    r = router(prefix_affinity=False)
    assert [r.route(prompt(1, 2)) for _ in range(4)] == [0, 1, 0, 1]
    assert not r._owner


def test_short_prompts_have_no_prefix_to_follow():
    r = router()
    assert [r.route([5, 6]) for _ in range(3)] == [0, 1, 0]


def test_at_least_one_replica():
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        router(n=0)
