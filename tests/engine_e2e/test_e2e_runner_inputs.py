"""The runner's host side, exactly: SchedulerOutput -> persistent input batch -> padded step
arrays, and the bucket padding rules. No model, no jax.

The step packed below (block_size 4, buckets T in (1, 2, ..., 64), S = min(T, 4), W in (4, 8)):

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

from jaxllm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.runner.buckets import BucketConfig, pad_to_bucket, power_of_two_buckets
from jaxllm.runner.input_batch import InputBatch
from jaxllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
A_PROMPT = [101, 102, 103, 104, 105, 106, 107]
B_PROMPT, B_OUTPUT = [301, 302, 303, 304, 305, 306], [307, 308, 309]
C_PROMPT, C_OUTPUT = [201, 202, 203, 204], [205, 206]
R = 4  # slots
EOS = 2


def params(**kwargs) -> SamplingParams:
    p = SamplingParams(**kwargs)
    p.seed = p.seed if p.seed is not None else 0
    return p


def so_of(new=(), cached=(), finished=(), preempted=()) -> SchedulerOutput:
    """A SchedulerOutput from (message, num_scheduled) pairs."""
    num = {m.req_id: n for m, n in [*new, *cached]}
    return SchedulerOutput([m for m, _ in new], [m for m, _ in cached], num,
                           sum(num.values()), set(finished), set(preempted))


def batch_before() -> InputBatch:
    """The runner already holds B (8 of its 9 tokens computed) and a request D."""
    batch = InputBatch(R, 32, 8, BLOCK_SIZE, eos_token_ids=[EOS])
    batch.update_states(so_of(new=[
        (NewRequestData("B", B_PROMPT, list(B_OUTPUT), params(), [2, 5], 7), 0),
        (NewRequestData("D", [1, 2], [], params(), [8], 1), 0)]))
    return batch


def step_message() -> SchedulerOutput:
    p = params()
    return so_of(new=[(NewRequestData("A", A_PROMPT, [], p, [3, 7], 0), 5),
                      (NewRequestData("C", C_PROMPT, C_OUTPUT, p, [4, 6], 2), 4)],
                 cached=[(CachedRequestData("B", [9], 8), 1)], finished={"D"})


def test_update_states_applies_the_messages():
    batch = batch_before()
    assert batch.req_id_to_slot == {"B": 0, "D": 1}
    batch.update_states(step_message())
    # D finished and left slot 1; A takes the lowest free slot (1), C the next (2).
    assert batch.req_id_to_slot == {"B": 0, "A": 1, "C": 2}
    b, c = batch.req_id_to_slot["B"], batch.req_id_to_slot["C"]
    assert batch.block_table.host[b, :batch.num_blocks[b]].tolist() == [2, 5, 9]
    assert batch.num_computed_tokens[b] == 8 and batch.num_computed_tokens[c] == 2
    assert batch.token_ids[c, :6].tolist() == C_PROMPT + C_OUTPUT
    assert (batch.num_tokens_known[c], batch.num_tokens[c], batch.num_prompt_tokens[c]) == \
        (6, 6, 4)


def test_update_states_drops_preempted_requests():
    batch = batch_before()
    batch.update_states(so_of(preempted={"B"}))
    assert batch.req_id_to_slot == {"D": 1} and batch.req_ids == [None, "D", None, None]


def test_prepare_packs_the_step_exactly():
    batch = batch_before()
    so = step_message()
    batch.update_states(so)
    inp = batch.prepare(so, BucketConfig.create(64, 4, 8, bucket_widths=True))

    assert inp.shape == (16, 4, 4)
    assert inp.req_ids == ["A", "C", "B"]
    assert inp.samples_S.tolist() == [False, True, True, False]
    pad = [0] * 6
    np.testing.assert_array_equal(
        inp.input_ids, [101, 102, 103, 104, 105, 203, 204, 205, 206, 309] + pad)
    np.testing.assert_array_equal(inp.positions, [0, 1, 2, 3, 4, 2, 3, 4, 5, 8] + pad)
    # slot = block * 4 + position % 4: A in blocks 3, 7; C in 4, 6; B's position 8 in block 9.
    np.testing.assert_array_equal(inp.slot_mapping[:10],
                                  [12, 13, 14, 15, 28, 18, 19, 24, 25, 36])
    assert (inp.slot_mapping[10:] // BLOCK_SIZE == 0).all(), "padding must write the null block"
    np.testing.assert_array_equal(batch.block_tables(inp),
                                  [[3, 7, 0, 0], [4, 6, 0, 0], [2, 5, 9, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(inp.seq_lens, [5, 6, 9, 0])
    np.testing.assert_array_equal(inp.query_start_loc, [0, 5, 9, 10, 10])
    np.testing.assert_array_equal(inp.logits_indices, [4, 8, 9, 0])
    np.testing.assert_array_equal(inp.slot_T, [1] * 5 + [2] * 4 + [0] + [R] * 6)
    np.testing.assert_array_equal(inp.slot_S, [1, 2, 0, R])
    assert not inp.from_device_T.any()
    assert int(inp.num_seqs) == 3
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens",
                 "query_start_loc", "logits_indices", "slot_T", "slot_S"):
        assert getattr(inp, name).dtype == np.int32, name
    # Sampling rows follow the batch order; steps = outputs before this sample.
    np.testing.assert_array_equal(inp.sampling.steps, [0, 2, 3, 0])
    np.testing.assert_array_equal(inp.sampling.penalties.prompt_lens, [7, 4, 6, 0])
    # Counters advanced: C and B each have one token in flight now.
    slots = batch.req_id_to_slot
    assert [int(batch.num_computed_tokens[slots[r]]) for r in "ACB"] == [5, 6, 9]
    assert [int(batch.num_tokens[slots[r]]) for r in "ACB"] == [7, 7, 10]
    assert [int(batch.num_tokens_known[slots[r]]) for r in "ACB"] == [7, 6, 9]


def test_placeholder_rows_read_the_device_and_fetched_tokens_fill_the_rows():
    """Async: B's sampled token is not known when the next step is packed."""
    batch = batch_before()
    so = step_message()
    batch.update_states(so)
    buckets = BucketConfig.create(64, 4, 8, bucket_widths=True)
    first = batch.prepare(so, buckets)
    nxt = so_of(cached=[(CachedRequestData("C", [], 6), 1), (CachedRequestData("B", [], 9), 1)])
    batch.update_states(nxt)
    second = batch.prepare(nxt, buckets)
    assert second.shape[0] == 2 and second.req_ids == ["C", "B"]
    np.testing.assert_array_equal(second.from_device_T, [True, True])
    np.testing.assert_array_equal(second.input_ids, [0, 0])
    np.testing.assert_array_equal(second.positions, [6, 9])
    # The first step's tokens arrive: A sampled nothing (mid-prompt), C 777, B 888.
    assert batch.record_sampled(first, np.array([5, 777, 888, 0])) == [[], [777], [888]]
    slots = batch.req_id_to_slot
    assert batch.token_ids[slots["C"], 6] == 777 and batch.token_ids[slots["B"], 9] == 888
    assert [int(batch.num_tokens_known[slots[r]]) for r in "CB"] == [7, 10]


def test_tokens_of_a_request_that_left_are_not_written_into_the_new_occupant():
    batch = batch_before()
    so = step_message()
    batch.update_states(so)
    step = batch.prepare(so, BucketConfig.create(64, 4, 8, bucket_widths=True))
    slot_b = batch.req_id_to_slot["B"]
    batch.update_states(so_of(new=[(NewRequestData("E", [9, 9], [], params(), [11], 0), 2)],
                              preempted={"B"}))
    assert batch.req_id_to_slot["E"] == slot_b  # B's slot, reused
    batch.record_sampled(step, np.array([0, 777, 888, 0]))
    assert batch.num_tokens_known[slot_b] == 2
    assert batch.token_ids[slot_b, :2].tolist() == [9, 9] and batch.token_ids[slot_b, 2] != 888


def test_prepare_pads_to_the_next_token_and_width_bucket():
    """17 tokens -> T = 32 (S = min(32, 4) = 4); a 5-block table -> W = 8."""
    prompt = list(range(1, 18))
    so = so_of(new=[(NewRequestData("X", prompt, [], params(), [1, 2, 3, 4, 5], 0), 17)])
    batch = InputBatch(R, 32, 8, BLOCK_SIZE, eos_token_ids=[EOS])
    batch.update_states(so)
    inp = batch.prepare(so, BucketConfig.create(64, 4, 8, bucket_widths=True))
    assert inp.shape == (32, 4, 8)
    np.testing.assert_array_equal(inp.input_ids[:17], prompt)
    assert not inp.input_ids[17:].any()
    np.testing.assert_array_equal(batch.block_tables(inp)[0], [1, 2, 3, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(inp.query_start_loc, [0, 17, 17, 17, 17])
    np.testing.assert_array_equal(inp.logits_indices, [16, 0, 0, 0])
    assert inp.samples_S.tolist() == [True, False, False, False]


def test_prompt_logprob_rows_score_the_next_prompt_token():
    prompt = [11, 12, 13, 14, 15, 16]
    p = params(prompt_logprobs=3)
    so = so_of(new=[(NewRequestData("X", prompt, [], p, [1, 2], 0), 4)])
    batch = InputBatch(R, 32, 8, BLOCK_SIZE, eos_token_ids=[EOS])
    batch.update_states(so)
    inp = batch.prepare(so, BucketConfig.create(64, 4, 8, bucket_widths=True))
    # Rows 0..3 (positions 0..3) score prompt tokens 1..4; the span starts at position 1.
    np.testing.assert_array_equal(inp.prompt_targets_T[:4], [12, 13, 14, 15])
    assert inp.shape[0] == 4 and inp.wants_prompt_logprobs_T.tolist() == [True] * 4
    assert inp.prompt_logprob_spans == {"X": (0, 4, 1, 3)}
    rest = so_of(cached=[(CachedRequestData("X", [], 4), 2)])
    batch.update_states(rest)
    inp = batch.prepare(rest, BucketConfig.create(64, 4, 8, bucket_widths=True))
    # Positions 4, 5: only position 4 has a prompt token after it (16).
    assert inp.prompt_logprob_spans == {"X": (0, 1, 5, 3)}
    assert inp.prompt_targets_T[0] == 16


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
    b = BucketConfig.create(64, 8, 16, bucket_widths=True, min_tokens=16)
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


def test_extra_token_buckets_join_the_powers_of_two_within_range():
    """Speculative decoding's 1 + k: a batch-1 verify step runs unpadded."""
    b = BucketConfig.create(64, 8, 16, bucket_widths=False, extra_tokens=(5,))
    assert b.token_buckets == (2, 4, 5, 8, 16, 32, 64)
    assert b.pad(5, 1, 16) == (5, 5, 16) and b.pad(6, 1, 16) == (8, 8, 16)
    # Outside [min bucket, max_num_batched_tokens], or already a bucket: nothing changes.
    for extra in ((1,), (65,), (8,)):
        assert BucketConfig.create(64, 8, 16, bucket_widths=False,
                                   extra_tokens=extra).token_buckets == (2, 4, 8, 16, 32, 64)


def test_sequence_bucket_is_tied_to_the_token_bucket():
    """S = min(T, max_num_seqs): never more sequences than tokens."""
    b = BucketConfig.create(128, 32, 4, bucket_widths=True, min_tokens=16)
    assert [b.seqs_for(T) for T in b.token_buckets] == [16, 32, 32, 32]
    assert b.pad(10, 10, 1) == (16, 16, 4)
    assert b.pad(20, 20, 1) == (32, 32, 4)


def test_small_budgets_and_unbucketed_widths():
    """A budget below the minimum bucket is the only bucket; Pallas uses one full width."""
    b = BucketConfig.create(8, 4, 2, bucket_widths=True, min_tokens=16)
    assert (b.token_buckets, b.width_buckets) == ((8,), (2,))
    b = BucketConfig.create(64, 8, 16, bucket_widths=False, min_tokens=16)
    assert b.width_buckets == (16,)
    assert b.pad(3, 2, 1) == (16, 8, 16)


def test_the_smallest_token_bucket_fits_batch_1_decode():
    b = BucketConfig.create(512, 64, 128, bucket_widths=False)
    assert b.token_buckets == (2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert b.pad(1, 1, 3) == (2, 2, 128)
    with pytest.raises(ValueError, match="min_tokens must be >= 2"):
        BucketConfig.create(512, 64, 128, bucket_widths=False, min_tokens=1)
