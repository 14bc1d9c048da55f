"""Prefix-cache keys: the chained hash of each full block of a request's tokens.

This file owns how a block of token ids (and the keys that must also match, such as a LoRA
id or a cache salt later) becomes a `BlockHash`, and how a request's list of hashes grows as
its blocks fill. It never touches blocks, pools or devices, and never uses Python's `hash()`,
which is salted per process and would make cache keys differ between runs.

Block i's hash covers all of tokens 0 .. (i+1)*block_size - 1, because it folds in the hash
of block i-1. Two requests share block i's K/V only if their whole prefixes agree:

    tokens:  [t0 .. t15] [t16 .. t31] [t32 .. t40]     (block_size 16, 41 tokens)
    hashes:   h0 = H(ROOT, t0..t15, extra)
              h1 = H(h0,   t16..t31, extra)
              (no h2: the last block is partial, so it is never shared)
"""

from __future__ import annotations

import array
import hashlib
import struct
from collections.abc import Sequence

# A sha256 digest. Bytes compare and hash fast as dict keys.
BlockHash = bytes

# The parent of a request's first block: a fixed value, so keys are stable across runs.
ROOT_HASH: BlockHash = hashlib.sha256(b"jaxllm prefix cache root").digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> BlockHash:
    """sha256 over (parent hash, number of tokens, the tokens as int64, extra keys).

    The parent is a fixed 32 bytes and the token count is written before the tokens, so no
    two different inputs serialize to the same bytes. Extra keys are serialized by `repr`,
    which is stable for the ints, strings and tuples they will hold.
    """
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(array.array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int],
                        block_size: int, extra_keys: tuple = ()) -> None:
    """Append the hashes of the full blocks of `token_ids` that `block_hashes` lacks.

    `token_ids` must hold only known tokens (not async placeholders): a block is hashed once
    every one of its tokens is known, and its hash never changes after that.
    """
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for start in range(len(block_hashes) * block_size,
                       len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        block_hashes.append(parent)


def hash_prefix(token_ids: Sequence[int], block_size: int,
                extra_keys: tuple = ()) -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids` (tests and tools)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, extra_keys)
    return hashes
