"""PoolingScheduler (jaxllm/pooling/scheduler.py): prompts are admitted first fit into the
step's attention blocks, the head of the queue always runs, later prompts fill the gaps, and
the ones passed over keep their order for the next step."""

from __future__ import annotations

from jaxllm.pooling import scheduler as sched
from jaxllm.pooling.attention import Tiling
from jaxllm.pooling.scheduler import PoolingRequest, PoolingScheduler


def add(s: PoolingScheduler, lens: list[int]) -> None:
    for i, n in enumerate(lens):
        s.add_request(PoolingRequest(str(i), tuple([1] * n), None, None, "embed"))


def ids(out) -> list[str]:
    return [r.request_id for r in out.requests]


def test_first_fit_fills_gaps_and_keeps_order():
    s = PoolingScheduler(16, 8, Tiling(8))  # two blocks of 8 rows
    add(s, [5, 6, 4, 3, 2, 8, 1])
    # 5 -> block 0; 6 -> block 1; 4 fits neither (3 and 2 left) and waits; 3 -> block 0;
    # 2 -> block 1; 8 waits; 1 fits nowhere (0 and 0 left)
    out = s.schedule()
    assert ids(out) == ["0", "1", "3", "4"] and out.total_num_scheduled_tokens == 16
    assert [r.request_id for r in s.waiting] == ["2", "5", "6"]
    out = s.schedule()  # 4 -> block 0, 8 -> block 1, 1 -> block 0
    assert ids(out) == ["2", "5", "6"] and out.total_num_scheduled_tokens == 13
    assert not s.has_unfinished_requests()


def test_max_num_seqs_and_lookahead_bound_a_step(monkeypatch):
    s = PoolingScheduler(16, 2, Tiling(8))
    add(s, [1, 1, 1])
    assert ids(s.schedule()) == ["0", "1"]
    monkeypatch.setattr(sched, "LOOKAHEAD", 1)
    s = PoolingScheduler(16, 8, Tiling(8))
    add(s, [8, 8, 8, 1])
    assert ids(s.schedule()) == ["0", "1"]  # "2" passed over; "3" not examined
    assert [r.request_id for r in s.waiting] == ["2", "3"]
