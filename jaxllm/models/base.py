"""AttentionMetadata: the device inputs every model step reads, as one registered pytree.

Owns: the field list and their shapes. Never a module-global "context": jit would bake it in.
All fields are data (traced); the static bucket sizes are the array shapes themselves.
"""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class AttentionMetadata:
    input_ids: jax.Array        # [T] int32, packed new tokens of all scheduled sequences
    positions: jax.Array        # [T] int32, position of each token in its sequence
    slot_mapping: jax.Array     # [T] int32, flat cache slot (block_id * block_size + offset);
                                #     padding rows point into the null block 0
    block_tables: jax.Array     # [S, max_blocks] int32, padding entries = 0 (null block)
    seq_lens: jax.Array         # [S] int32, cached + new tokens per sequence, 0 for padding
    query_start_loc: jax.Array  # [S + 1] int32, start of each sequence's rows in the packing
    num_seqs: jax.Array         # [] int32, sequences past it are padding

# A KV cache is a list with one (k, v) per layer, each [num_blocks, block_size, K, H].
KVCache = list[tuple[jax.Array, jax.Array]]
