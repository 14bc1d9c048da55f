"""Exact block ownership of KVCacheManager, and the start-up capacity check."""

import functools

import pytest

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.kv_capacity import check_fits
from jaxllm.sampling_params import SamplingParams
from jaxllm.engine.request import Request


# The real SamplingParams (pure Python); a short max_tokens keeps the runs small.
Params = functools.partial(SamplingParams, max_tokens=16)


def make_request(req_id: str, prompt_len: int) -> Request:
    return Request(req_id, list(range(prompt_len)), Params(), eos_token_id=None, arrival_time=0.0)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def test_allocate_and_free_exact_ids():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_model_len=16)
    a, b = make_request("a", 10), make_request("b", 5)
    assert kv.allocate_slots(a, 10) == [1, 2, 3]
    assert kv.allocate_slots(b, 5) == [4, 5]
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.get_block_ids("b") == [4, 5]
    assert kv.num_free_blocks == 2
    assert kv.usage == pytest.approx(5 / 7)

    kv.free(a)
    assert free_ids(kv) == [6, 7, 3, 2, 1]
    assert kv.get_block_ids("a") == []
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [0, 0, 0, 0, 1, 1, 0, 0]
    kv.free(a)  # freeing a request with no blocks is a no-op, not a double free
    assert kv.num_free_blocks == 5


def test_allocate_grows_only_at_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_model_len=16)
    req = make_request("r", 6)
    assert kv.allocate_slots(req, 6) == [1, 2]
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) == []  # positions 6, 7 still fit in block 2
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1) == [3]
    assert kv.allocate_slots(req, 0) == []
    assert kv.get_block_ids("r") == [1, 2, 3]


def test_allocate_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(num_blocks=5, block_size=4, max_model_len=16)
    a, b = make_request("a", 12), make_request("b", 8)
    assert kv.allocate_slots(a, 12) == [1, 2, 3]
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids("b") == []
    assert free_ids(kv) == [4]
    assert kv.allocate_slots(b, 4) == [4]


def test_allocate_rejects_negative():
    kv = KVCacheManager(num_blocks=5, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(make_request("a", 3), -1)


def test_check_fits_accepts_exact_fit():
    check_fits(num_blocks=5, block_size=4, max_model_len=16)  # 4 usable blocks, 4 needed


def test_check_fits_message_names_the_numbers_and_the_knob():
    with pytest.raises(ValueError) as info:
        KVCacheManager(num_blocks=4, block_size=4, max_model_len=16)
    message = str(info.value)
    assert "needs 4 blocks" in message
    assert "only 3 blocks are available" in message
    assert "max_model_len to at most 12" in message
    assert "gpu_memory_utilization" in message


@pytest.mark.parametrize("kwargs", [dict(block_size=0), dict(max_model_len=0)])
def test_check_fits_rejects_nonpositive_sizes(kwargs):
    args = dict(num_blocks=8, block_size=4, max_model_len=16) | kwargs
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        check_fits(**args)


def test_sliding_window_gives_back_blocks_before_it():
    # block_size 4, window 8: once c tokens are computed, keys before c - 7 are never read.
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=32, sliding_window=8)
    a = make_request("a", 10)
    assert kv.allocate_slots(a, 10) == [1, 2, 3]
    a.num_computed_tokens = 10  # next token 10 sees keys 3..10: block 1 still needed
    assert kv.allocate_slots(a, 2) == []
    assert kv.get_block_ids("a") == [1, 2, 3]
    a.num_computed_tokens = 12  # next token 12 sees keys 5..12: block 1 (keys 0..3) goes
    assert kv.allocate_slots(a, 1) == [4]
    assert kv.get_block_ids("a") == [0, 2, 3, 4]
    assert free_ids(kv) == [5, 6, 7, 8, 9, 1]
    a.num_computed_tokens = 21  # keys 14..21: blocks 2 and 3 go, the last one first
    assert kv.allocate_slots(a, 2) == [5, 6]
    assert kv.get_block_ids("a") == [0, 0, 0, 4, 5, 6]
    assert free_ids(kv) == [7, 8, 9, 1, 3, 2]
    kv.free(a)  # the null placeholders are not freed again
    assert free_ids(kv) == [7, 8, 9, 1, 3, 2, 6, 5, 4]
    assert kv.block_pool.null_block.ref_cnt == 0 and kv.num_free_blocks == 9


def test_sliding_window_keeps_given_back_blocks_in_the_prefix_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=32, sliding_window=4)
    a = make_request("a", 13)
    assert kv.allocate_slots(a, 13) == [1, 2, 3, 4]  # blocks 1..3 full: offered to the cache
    a.num_computed_tokens = 13
    kv.allocate_slots(a, 1)  # next token 13 sees keys 10..13: blocks 1, 2 go
    assert kv.get_block_ids("a") == [0, 0, 3, 4]
    # A new request with the same prompt still hits the freed blocks (their K/V is intact).
    b = make_request("b", 13)
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2, 3] and num_hit == 12


def test_no_window_keeps_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=4, max_model_len=32)
    a = make_request("a", 20)
    assert kv.allocate_slots(a, 20) == [1, 2, 3, 4, 5]
    a.num_computed_tokens = 20
    kv.allocate_slots(a, 1)
    assert kv.get_block_ids("a") == [1, 2, 3, 4, 5, 6]
