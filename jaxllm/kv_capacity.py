"""Whether one request of max_model_len fits a KV cache of num_blocks: the capacity check
the block manager (engine/) and the byte budget (runner/kv_cache.py) share.

Owns: the arithmetic and the error message. Imports no layer and never touches a device.
"""

from __future__ import annotations


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
