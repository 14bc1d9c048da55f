"""The runner's host side, exactly: SchedulerOutput -> runner states -> padded step arrays,
and the bucket padding rules. No model, no jax.

The step packed below (block_size 4, buckets T in (16, 32, 64), S = min(T, 4), W in (4, 8)):

    request  message          prompt  output  computed  scheduled  rows   positions
    A        new              7       0       0         5          0..4   0..4  (chunk: no sample)
    C        new (resumed)    4       2       2         4          5..8   2..5  (prompt + output)
    B        cached, +block 9 6       3       8         1          9      8     (decode)
    padding                                                        10..15 -> null block 0

Rows are new requests first, then cached ones (the runner's order, not the scheduler's).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.engine.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.runner.buckets import BucketConfig, pad_to_bucket, power_of_two_buckets
from jaxllm.runner.input_batch import CachedRequestState, prepare_inputs, update_states
from jaxllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
A_PROMPT = [101, 102, 103, 104, 105, 106, 107]
B_PROMPT, B_OUTPUT = [301, 302, 303, 304, 305, 306], [307, 308, 309]
C_PROMPT, C_OUTPUT = [201, 202, 203, 204], [205, 206]


def _states_before() -> dict[str, CachedRequestState]:
    """The runner already holds B (8 of its 9 tokens computed) and a request D."""
    return {
        "B": CachedRequestState("B", B_PROMPT, list(B_OUTPUT), SamplingParams(), [2, 5], 7),
        "D": CachedRequestState("D", [1, 2], [], SamplingParams(), [8], 1),
    }


def _scheduler_output() -> SchedulerOutput:
    params = SamplingParams()
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("A", A_PROMPT, [], params, [3, 7], 0),
            NewRequestData("C", C_PROMPT, C_OUTPUT, params, [4, 6], 2),
        ],
        scheduled_cached_reqs=[CachedRequestData("B", [9], 8)],
        num_scheduled_tokens={"A": 5, "B": 1, "C": 4},
        total_num_scheduled_tokens=10,
        finished_req_ids={"D"},
        preempted_req_ids=set(),
    )


def test_update_states_applies_the_messages():
    states = _states_before()
    update_states(states, _scheduler_output())
    assert sorted(states) == ["A", "B", "C"]  # D finished: dropped
    assert states["B"].block_ids == [2, 5, 9]
    assert states["B"].num_computed_tokens == 8
    assert states["C"].output_token_ids == C_OUTPUT
    assert states["C"].num_computed_tokens == 2
    assert states["A"].block_ids == [3, 7]


def test_update_states_drops_preempted_requests():
    states = _states_before()
    so = SchedulerOutput([], [], {}, 0, finished_req_ids=set(), preempted_req_ids={"B"})
    update_states(states, so)
    assert sorted(states) == ["D"]


def test_prepare_inputs_packs_the_step_exactly():
    states = _states_before()
    so = _scheduler_output()
    update_states(states, so)
    buckets = BucketConfig.create(64, 4, 8, bucket_widths=True)
    inp = prepare_inputs(states, so, buckets, BLOCK_SIZE)

    assert inp.shape == (16, 4, 4)
    assert inp.req_ids == ["A", "C", "B"]
    assert inp.samples == [False, True, True]
    pad = [0] * 6
    np.testing.assert_array_equal(
        inp.input_ids, [101, 102, 103, 104, 105, 203, 204, 205, 206, 309] + pad)
    np.testing.assert_array_equal(inp.positions, [0, 1, 2, 3, 4, 2, 3, 4, 5, 8] + pad)
    # slot = block * 4 + position % 4: A in blocks 3, 7; C in 4, 6; B's position 8 in block 9.
    np.testing.assert_array_equal(inp.slot_mapping[:10],
                                  [12, 13, 14, 15, 28, 18, 19, 24, 25, 36])
    assert (inp.slot_mapping[10:] // BLOCK_SIZE == 0).all(), "padding must write the null block"
    np.testing.assert_array_equal(inp.block_tables,
                                  [[3, 7, 0, 0], [4, 6, 0, 0], [2, 5, 9, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(inp.seq_lens, [5, 6, 9, 0])
    np.testing.assert_array_equal(inp.query_start_loc, [0, 5, 9, 10, 10])
    np.testing.assert_array_equal(inp.logits_indices, [4, 8, 9, 0])
    assert int(inp.num_seqs) == 3
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "query_start_loc", "logits_indices"):
        assert getattr(inp, name).dtype == np.int32, name


def test_prepare_inputs_pads_to_the_next_token_and_width_bucket():
    """17 tokens -> T = 32 (S = min(32, 4) = 4); a 5-block table -> W = 8."""
    params = SamplingParams()
    prompt = list(range(1, 18))
    so = SchedulerOutput([NewRequestData("X", prompt, [], params, [1, 2, 3, 4, 5], 0)], [],
                         {"X": 17}, 17, set(), set())
    states = {}
    update_states(states, so)
    inp = prepare_inputs(states, so, BucketConfig.create(64, 4, 8, bucket_widths=True),
                         BLOCK_SIZE)
    assert inp.shape == (32, 4, 8)
    np.testing.assert_array_equal(inp.input_ids[:17], prompt)
    assert not inp.input_ids[17:].any()
    np.testing.assert_array_equal(inp.block_tables[0], [1, 2, 3, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(inp.query_start_loc, [0, 17, 17, 17, 17])
    np.testing.assert_array_equal(inp.logits_indices, [16, 0, 0, 0])
    assert inp.samples == [True]


# ---- buckets -------------------------------------------------------------------------------

def test_power_of_two_buckets_end_exactly_at_the_maximum():
    assert power_of_two_buckets(16, 64) == (16, 32, 64)
    assert power_of_two_buckets(16, 48) == (16, 32, 48)
    assert power_of_two_buckets(16, 16) == (16,)
    assert power_of_two_buckets(4, 20, base=4) == (4, 16, 20)


def test_pad_to_bucket_rounds_up_and_rejects_overflow():
    assert [pad_to_bucket(n, (16, 32, 64), "t") for n in (1, 16, 17, 33, 64)] == \
        [16, 16, 32, 64, 64]
    with pytest.raises(ValueError, match=r"num_tokens=65 exceeds the largest bucket 64"):
        pad_to_bucket(65, (16, 32, 64), "num_tokens")


def test_bucket_config_create_and_pad():
    b = BucketConfig.create(64, 8, 16, bucket_widths=True)
    assert b.token_buckets == (16, 32, 64)
    assert b.width_buckets == (4, 16)
    assert b.pad(1, 1, 1) == (16, 8, 4)
    assert b.pad(17, 3, 5) == (32, 8, 16)
    assert b.pad(64, 8, 16) == (64, 8, 16)
    with pytest.raises(ValueError, match="num_tokens=65"):
        b.pad(65, 1, 1)
    with pytest.raises(ValueError, match="blocks per sequence=17"):
        b.pad(16, 1, 17)
    assert b.all_shapes() == [(16, 8, 4), (16, 8, 16), (32, 8, 4), (32, 8, 16),
                              (64, 8, 4), (64, 8, 16)]


def test_sequence_bucket_is_tied_to_the_token_bucket():
    """S = min(T, max_num_seqs): never more sequences than tokens."""
    b = BucketConfig.create(128, 32, 4, bucket_widths=True)
    assert [b.seqs_for(T) for T in b.token_buckets] == [16, 32, 32, 32]
    assert b.pad(10, 10, 1) == (16, 16, 4)
    assert b.pad(20, 20, 1) == (32, 32, 4)


def test_small_budgets_and_unbucketed_widths():
    """A budget below the minimum bucket is the only bucket; Pallas uses one full width."""
    b = BucketConfig.create(8, 4, 2, bucket_widths=True)
    assert (b.token_buckets, b.width_buckets) == ((8,), (2,))
    b = BucketConfig.create(64, 8, 16, bucket_widths=False)
    assert b.width_buckets == (16,)
    assert b.pad(3, 2, 1) == (16, 8, 16)
