"""Which request holds which KV blocks.

This file maps request ids to their block lists on top of `BlockPool`, grows those lists as a
request computes more tokens, and gives them back when it finishes or is preempted. With
prefix caching it also finds a request's cached prefix (`get_computed_blocks`) and offers its
full blocks to the cache (`cache_blocks`). It never decides *who* gets blocks (that is the
scheduler) and never touches device memory.

A request's block list covers its first `len(blocks) * block_size` token positions; token
position p lives in slot `p % block_size` of block `blocks[p // block_size]`.

Sliding window (`sliding_window` W: every layer of the model attends with it, as Mistral
v0.1's). No token from position c on sees keys before c - W + 1, so once a request has
computed c tokens its blocks wholly before that are given back (vLLM's sliding-window
manager) and its list holds the null block in their place; the attention kernels never read
pages before a window, and the runner's block table may keep the old ids:

    block_size 4, W = 8, 14 tokens computed: the next token (position 14) sees keys 7..14
      blocks  [null][ b2 ][ b3 ][ b4 ]      b1 (keys 0..3) freed; b2 holds key 7, kept
    A freed block keeps its prefix-cache hash until it is evicted, like any freed block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import dataclasses

from jaxllm.engine.block_hash import ROOT_HASH, hash_block_tokens
from jaxllm.engine.block_pool import BlockPool, KVCacheBlock
from jaxllm.kv_capacity import cdiv, check_fits
from jaxllm.research.requests import reads_prefix_cache

if TYPE_CHECKING:
    from jaxllm.engine.request import Request


@dataclasses.dataclass(frozen=True)
class CachedTail:
    """A cached partial block that continues a request's cached prefix: its first
    `num_tokens` slots hold the K/V the request needs next."""

    block: KVCacheBlock
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, sliding_window: int | None = None) -> None:
        check_fits(num_blocks, block_size, max_model_len)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks were already offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # (source, destination) block ids of cached tails to copy on the device before the
        # next step runs; the scheduler takes them into its SchedulerOutput.
        self.blocks_to_copy: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1] (the null block is not counted; free
        blocks that still hold a cached prefix count as free)."""
        return self.block_pool.usage

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    # -- prefix caching -------------------------------------------------------------------
    def uses_prefix_cache(self, request: Request) -> bool:
        """Whether a lookup is made for this request: not when caching is off, nor when it
        wants prompt logprobs (every prompt position must then be computed, as in vLLM),
        nor when it captures activations (a cached position would not be captured)."""
        params = request.sampling_params
        return (self.enable_caching and params.prompt_logprobs is None
                and reads_prefix_cache(params))

    def update_block_hashes(self, request: Request) -> None:
        if self.enable_caching:
            request.update_block_hashes(self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix of the request's full blocks found in the cache, and its length
        in tokens. Takes no reference: `allocate_slots` does, if the request is admitted.

        The hit stops at num_tokens - 1 tokens: the last token is always computed, because
        its logits give the next sample. Only whole blocks count, so a block-aligned prompt
        that is fully cached recomputes its whole last block:

            prompt of 8, block_size 4, both blocks cached -> hit = 1 block (4 tokens)
        """
        if not self.uses_prefix_cache(request):
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_cached_tail(self, request: Request, num_hit: int) -> CachedTail | None:
        """The longest cached tail continuing the request's first `num_hit` tokens (a
        block-aligned hit from get_computed_blocks), still leaving its last token to compute:

            block_size 4, prompt of 11, 8 tokens hit, tail [t8 t9] cached by a finished
            request -> CachedTail(that block, 2): the request computes t10 only
        """
        if not self.uses_prefix_cache(request) or not self.block_pool.cached_tail_to_block:
            return None
        limit = min(self.block_size - 1, request.num_tokens - 1 - num_hit)
        k = num_hit // self.block_size
        parent = request.block_hashes[k - 1] if k else ROOT_HASH
        tokens = request.all_token_ids[num_hit:num_hit + limit]
        for m in range(limit, 0, -1):
            block = self.block_pool.get_cached_tail(
                hash_block_tokens(parent, tokens[:m], request.cache_extra_keys))
            if block is not None:
                return CachedTail(block, m)
        return None

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the prefix cache the request's full blocks within its first `num_tokens`
        positions whose K/V is computed or scheduled, once their tokens are known."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        stop = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, stop):
            if blocks[i] is not self.block_pool.null_block:  # not given back by the window
                self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, stop)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing forgotten) while blocks are held."""
        return self.block_pool.reset_prefix_cache()

    # -- blocks in and out ----------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       tail: CachedTail | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more K/V entries after the computed ones.

        `new_computed_blocks` are cache hits from `get_computed_blocks` (waiting requests
        only): the request takes a reference to each and its new tokens start after them.

            blocks:  [hit][hit][ new ... ]
                     <- cached -> <- num_new_tokens ->   (num_computed_tokens is still 0;
                                                          the scheduler moves it past the hits)

        With a cached `tail` (get_cached_tail) its tokens count as computed too: the first
        fresh block receives a device copy of the tail block (`blocks_to_copy`).

        Returns the ids of the blocks added (hits first, possibly none), or None, with
        nothing changed, when the free queue is too short. The full blocks covered by the new
        tokens are offered to the prefix cache at once: K/V scheduled this step counts as
        computed, so a request admitted later in the same step already shares them.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        self.remove_skipped_blocks(request)
        num_computed = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                        + (tail.num_tokens if tail is not None else 0))
        num_tokens = num_computed + num_new_tokens
        assert num_tokens <= self.max_model_len, (
            request.request_id, request.num_computed_tokens, num_new_tokens)
        held = self.req_to_blocks.get(request.request_id, [])
        num_needed = max(0, cdiv(num_tokens, self.block_size) - len(held)
                         - len(new_computed_blocks))
        # A hit that sits in the free queue leaves it: it costs a free block too.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed + num_evictable_hits > self.block_pool.num_free_blocks:
            return None
        # Hits first: taken out of the queue before fresh blocks are popped from its front.
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        if tail is not None:
            # The copy runs before this step writes anything, so even a source block just
            # handed out again (here or to another request) is read intact.
            self.blocks_to_copy.append((tail.block.block_id, new_blocks[0].block_id))
        added = [*new_computed_blocks, *new_blocks]
        self.req_to_blocks.setdefault(request.request_id, []).extend(added)
        self.cache_blocks(request, num_tokens)
        return [block.block_id for block in added]

    def remove_skipped_blocks(self, request: Request) -> None:
        """Give back the request's blocks wholly before the sliding window of its next token
        (position num_computed_tokens), the last of them first so its earliest (most
        shareable) prefix is evicted last; the null block takes their places."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return
        first_seen = request.num_computed_tokens - self.sliding_window + 1
        null = self.block_pool.null_block
        skipped = []
        for i in range(min(max(first_seen, 0) // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # given back at an earlier step, with everything before it
            skipped.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(skipped)

    def num_blocks_before(self, request: Request, num_new: int) -> int:
        """Blocks the request held before its latest `num_new` were added."""
        return len(self.req_to_blocks.get(request.request_id, ())) - num_new

    def free_blocks_after(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` positions, last first
        (speculative decoding: blocks that held only rejected drafts; never cached, since
        a draft's id is not a known token)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        freed = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(freed))

    def uncache_scheduled(self, request: Request) -> None:
        """The request's tokens scheduled this step will not be computed after all (it was
        preempted in the same step): blocks past its computed tokens, offered to the prefix
        cache when scheduled, leave it."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        self.block_pool.uncache(blocks[request.num_computed_tokens // self.block_size:])

    def free(self, request: Request, *, uncache: bool = False,
             cache_tail: bool = False) -> None:
        """Give back every block of the request, tail first, so that its least shareable
        blocks (the tail) are evicted before its prefix. Blocks others hold stay theirs.
        `uncache`: the request's step failed, so K/V it was to write cannot be trusted;
        its blocks leave the prefix cache (conservatively, all of them).
        `cache_tail`: the request finished normally; the partial block of its computed
        tokens is offered to the prefix cache as a tail (block_pool.py)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if cache_tail and not uncache and self.enable_caching:
            self._cache_tail(request, blocks)  # (never a block the window gave back)
        held = [b for b in blocks if b is not self.block_pool.null_block]
        if uncache:
            self.block_pool.uncache(held)
        self.block_pool.free_blocks(reversed(held))

    def _cache_tail(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        # Only known tokens: an async placeholder's K/V is in flight but its id is not here.
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        k, m = divmod(num_tokens, self.block_size)
        if m == 0 or len(blocks) <= k or blocks[k].ref_cnt != 1:
            return
        self.update_block_hashes(request)
        parent = request.block_hashes[k - 1] if k else ROOT_HASH
        tail_hash = hash_block_tokens(parent, request.all_token_ids[k * self.block_size:
                                                                    num_tokens],
                                      request.cache_extra_keys)
        self.block_pool.cache_tail(blocks[k], tail_hash)
