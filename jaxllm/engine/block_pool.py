"""Who owns which KV block: the block objects, their reference counts, and the free queue.

This file owns the bookkeeping of the paged KV cache on the host. It never touches device
memory, never knows about requests (that is `kv_cache_manager.py`), and never imports jax.

Layout of the pool (num_blocks = 8):

    block id:    0      1   2   3   4   5   6   7
                 null   <--- handed out to requests --->

Block 0 is the null block: padding rows of a packed batch write their K/V there, so it is
taken out of the free queue at start-up and is never handed to a request.

The free queue is a doubly linked list threaded through the blocks themselves (no Python
objects are created when blocks move), bracketed by two sentinels so that popleft, append and
removal from the middle are all O(1) with no empty-list special cases:

    head <-> b3 <-> b1 <-> b7 <-> tail
    ^ evicted first         ^ freed most recently

Prefix caching: a full block whose K/V is computed (or scheduled to be) carries its
`block_hash` (engine/block_hash.py) and is indexed in `cached_block_hash_to_block`. When its
ref_cnt drops to 0 it goes back on the free queue *with* its hash: its K/V stays valid and a
later request can take it back out (`touch`, O(1) via `FreeKVCacheBlockQueue.remove`). It is
evicted when the queue hands it out as a fresh block (`_forget_hash`; apart from a reset or
a failed step, the only eviction point), so eviction follows the queue: least recently
freed first, and a request's tail before its prefix (requests free their blocks in reverse).

    ref_cnt > 0, hashed      held, and shareable: a hit adds a reference
    ref_cnt = 0, hashed      free but cached: a hit takes it out of the queue
    ref_cnt = 0, no hash     free and empty

One block per hash is indexed. A second block computed with the same tokens (two requests
that prefilled the same prefix in different steps) stays unhashed: it is an ordinary block
of its owner and is never shared.

Cached tails: when a request finishes, the partial last block of its computed tokens is
indexed too (`cached_tail_to_block`, keyed by the hash of its parent block and its m < block
size tokens). It is never shared, since its owner's successor would write into it: a later
request whose prefix continues it gets a fresh block and a device copy of the tail
(kv_cache_manager.py). Beam search and multi-turn chat continue exactly such tails. A tail
block is free (ref_cnt 0) and evicted like any cached block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxllm.engine.block_hash import BlockHash

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One fixed-size block of the paged KV cache (host-side metadata only)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Hash of the full block's tokens, chained with the previous block's hash; set only
        # while the block is the indexed one for that hash.
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is held by a request.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """O(1) doubly linked queue of free blocks, in eviction order (front is evicted first)."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Sentinels (block_id -1) are never returned; they remove every edge case.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("popleft from an empty free block queue")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it sits in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front-to-back snapshot, O(n): for tests and debugging only."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV blocks, the free queue, and the prefix-hash index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Block 0 is held forever by nobody: out of the queue, never handed out.
        self.null_block = self.free_block_queue.popleft()
        assert self.null_block.block_id == NULL_BLOCK_ID
        # Prefix caching: block_hash -> the block whose K/V for those tokens is valid (held
        # or free). Stays empty when prefix caching is off: nobody calls cache_block.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Cached tails: hash of (parent hash, the m tokens) -> a free block holding their K/V
        # in its first m slots.
        self.cached_tail_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (null block excluded) held by requests."""
        num_usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / num_usable

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the front of the free queue; each comes back with ref_cnt 1."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            assert block.ref_cnt == 0, block
            self._forget_hash(block)
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 go to the back of the queue
        in the given order (callers pass a request's blocks tail-first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # -- prefix caching -----------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each (cache-hit) block, taking free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Index a held, full block under `block_hash` (its K/V is computed or scheduled).
        If another block already holds that hash, this one stays an unshared duplicate."""
        if block.ref_cnt <= 0:
            raise ValueError(f"cannot cache {block}: it is not held")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"{block} is already cached under another hash")
            return
        if block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def cache_tail(self, block: KVCacheBlock, tail_hash: BlockHash) -> None:
        """Index a block its only holder is about to free, under the hash of the partial
        prefix it holds. A block that is already indexed (a full block) is left alone."""
        if block.ref_cnt != 1 or block is self.null_block:
            raise ValueError(f"cannot cache the tail {block}: it is not held by one request")
        if block.block_hash is None and tail_hash not in self.cached_tail_to_block:
            block.block_hash = tail_hash
            self.cached_tail_to_block[tail_hash] = block

    def get_cached_tail(self, tail_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_tail_to_block.get(tail_hash)

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop blocks from the index, held or not (their K/V can no longer be trusted)."""
        for block in blocks:
            self._forget_hash(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held, since a holder
        may be about to share what it holds (vLLM's rule)."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for index in (self.cached_block_hash_to_block, self.cached_tail_to_block):
            for block in index.values():
                block.block_hash = None
            index.clear()
        return True

    def _forget_hash(self, block: KVCacheBlock) -> None:
        # A block leaving the free queue for a new owner loses whatever cached prefix it
        # held: this is the eviction point of the prefix cache.
        if block.block_hash is None:
            return
        for index in (self.cached_block_hash_to_block, self.cached_tail_to_block):
            if index.get(block.block_hash) is block:
                del index[block.block_hash]
        block.block_hash = None
