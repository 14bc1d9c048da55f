"""Exact block ids, ref counts and free-queue order of the block pool."""

import pytest

from jaxllm.engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_null_block_is_reserved_at_start():
    pool = BlockPool(6)
    assert pool.null_block.block_id == 0
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


def test_null_block_never_handed_out():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([pool.null_block])


def test_allocate_then_free_in_reverse_appends_tail_first():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert [x.block_id for x in a] == [1, 2, 3]
    assert [x.block_id for x in b] == [4, 5]
    assert [x.ref_cnt for x in a + b] == [1] * 5
    assert free_ids(pool) == [6, 7]

    pool.free_blocks(reversed(a))  # how KVCacheManager.free passes a request's blocks
    assert free_ids(pool) == [6, 7, 3, 2, 1]
    assert [x.ref_cnt for x in a] == [0, 0, 0]
    assert pool.usage == pytest.approx(2 / 7)

    # The oldest free blocks go first; A's tail (3) is reused before its head (1).
    c = pool.get_new_blocks(3)
    assert [x.block_id for x in c] == [6, 7, 3]
    assert free_ids(pool) == [2, 1]


def test_ref_counts_shared_block_returns_only_at_zero():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    blk.ref_cnt += 1  # a second owner, as prefix caching will do
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and free_ids(pool) == [2, 3]
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_ids(pool) == [2, 3, 1]
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blk])
    assert free_ids(pool) == [2, 3, 1]


def test_queue_remove_from_middle_relinks_neighbours():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 3, 4]
    assert queue.num_free_blocks == 4
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    # Removing the ends works the same way thanks to the sentinels.
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3]
    queue.append(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 2]
    assert queue.popleft() is blocks[1]
    assert queue.num_free_blocks == 2


def test_queue_rejects_misuse():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    queue.remove(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])
    queue.popleft()
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()
    assert queue.num_free_blocks == 0
    queue.append_n(blocks)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1]


def test_reusing_a_block_forgets_its_cached_hash():
    # No prefix caching yet, but the eviction point must already keep the index honest.
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    blk.block_hash = "h"
    pool.cached_block_hash_to_block["h"] = blk
    pool.free_blocks([blk])
    assert blk.block_hash == "h"  # a freed block stays reusable until it is handed out again
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert blk.block_hash is None
    assert pool.cached_block_hash_to_block == {}


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)
