"""Which request holds which KV blocks.

This file maps request ids to their block lists on top of `BlockPool`, grows those lists as a
request computes more tokens, and gives them back when it finishes or is preempted. It never
decides *who* gets blocks (that is the scheduler) and never touches device memory.

A request's block list covers its first `len(blocks) * block_size` token positions; token
position p lives in slot `p % block_size` of block `blocks[p // block_size]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxllm.engine.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from jaxllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_fits(num_blocks: int, block_size: int, max_model_len: int, *,
               bytes_per_block: int | None = None, budget_bytes: int | None = None) -> None:
    """Fail at start-up, not mid-generation, if one max_model_len request cannot fit.

    Preemption can always free every other request's blocks, so this is the only capacity
    condition the scheduler needs to make progress. `bytes_per_block` and `budget_bytes`, when
    the caller knows them, make the error say how much memory is missing.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    needed = cdiv(max_model_len, block_size)
    available = max(num_blocks - 1, 0)  # block 0 is the reserved null block
    if needed <= available:
        return

    def blocks(n: int) -> str:
        return "1 block" if n == 1 else f"{n} blocks"

    budget = "The KV cache budget" + (
        f" of {budget_bytes} bytes" if budget_bytes is not None else "")
    each = f" of {bytes_per_block} bytes each" if bytes_per_block else ""
    want = needed + 1
    more = f"raise kv_cache_memory_bytes to at least {want * bytes_per_block}" \
        if bytes_per_block else "raise kv_cache_memory_bytes"
    grow = (f"give the KV cache at least {want} blocks: {more}, raise gpu_memory_utilization "
            f"(on an accelerator), or set num_gpu_blocks_override >= {want}.")
    # With no usable block no max_model_len fits: never suggest one <= 0.
    fix = f"Lower max_model_len to at most {available * block_size}, or {grow}" \
        if available else f"No max_model_len fits in this budget; {grow}"
    raise ValueError(
        f"The KV cache is too small for one request of max_model_len={max_model_len}: it "
        f"needs {blocks(needed)} of block_size={block_size} tokens, but only "
        f"{blocks(available)} {'is' if available == 1 else 'are'} available. {budget} holds "
        f"{blocks(num_blocks)}{each}, and one block is always reserved as the null block. "
        f"{fix}")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        check_fits(num_blocks, block_size, max_model_len)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1] (the null block is not counted)."""
        return self.block_pool.usage

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks the request must gain to hold num_computed_tokens + num_new_tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more K/V entries after the computed ones.

        Returns the ids of the newly added blocks (possibly empty), or None, with nothing
        changed, when the free queue is too short.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        assert request.num_computed_tokens + num_new_tokens <= self.max_model_len, (
            request.request_id, request.num_computed_tokens, num_new_tokens)
        num_needed = self.num_blocks_needed(request, num_new_tokens)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        # Prefix caching will slot in here: look up the request's full-block hashes first and
        # take cache hits back out of the free queue before asking for fresh blocks.
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        self.req_to_blocks.setdefault(request.request_id, []).extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Give back every block of the request, tail first, so that with prefix caching its
        least shareable blocks (the tail) are evicted before its prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
