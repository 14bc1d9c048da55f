"""What a pooling step's model reads: packed sequences with no KV cache, and the attention that
keeps each sequence to itself.

Owns `PoolingMetadata` (the step's device inputs, one registered pytree), the block layout of
a step (`Tiling`: blocks of B rows, `BlockPacking`: where each prompt's rows go) and
`DenseAttention`, the object a model's `ops.attention` calls in a pooling step: scores within
each block, masked to the row's own sequence (and to earlier positions when causal), in
float32. Never touches a KV cache: the `kv` argument passes through untouched (a pooling step
has none), and there is no prefix to reuse.

Letters: T packed tokens (a bucket), S sequences (a bucket), N query heads, K kv heads,
H head dim, G blocks of B rows.

Blocks. Scores over the whole step cost T * T per head where the prompts need only the sum of
their squares. So the step's rows are cut into blocks of B >= max_model_len rows (a power of
two) and every prompt is packed inside one block (first fit, `BlockPacking`; the scheduler
admits a prompt only where it fits): a block's queries then score only its own B keys, a
block-diagonal attention with no gather of neighbouring keys. A step of T <= B rows is one
block.

    B = 8, T = 16:  | a a a b b c c . | d d d d d e e . |     seq_ids 0 0 0 1 1 2 2 S 3 ...
                      block 0           block 1             `.`: padding (sequence S)
    a row of `b` sees the two `b` columns only; padding rows see padding only (never NaN).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PoolingMetadata:
    input_ids: jax.Array        # [T] int32, packed tokens of every scheduled sequence
    positions: jax.Array        # [T] int32, position of each token in its sequence
    token_type_ids: jax.Array   # [T] int32, BERT's segment (0 for the first text of a pair)
    seq_ids: jax.Array          # [T] int32, the row's sequence, S for padding rows
    query_start_loc: jax.Array  # [S + 1] int32, start of each sequence's rows
    seq_lens: jax.Array         # [S] int32, tokens per sequence, 0 for padding


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Attention blocks of `tile` rows (static: part of the step); no prompt crosses a block
    edge."""

    tile: int

    @classmethod
    def for_max_model_len(cls, max_model_len: int) -> "Tiling":
        """The smallest power of two that holds the longest prompt."""
        return cls(1 << max(0, max_model_len - 1).bit_length())


class BlockPacking:
    """First-fit placement of prompts into `num_blocks` blocks of `block` rows: the scheduler
    admits with it and the runner replays it in the same order, so both agree on the rows.

        BlockPacking(4, 2): add(3) -> 0, add(3) -> 4, add(1) -> 3, add(2) -> None
    """

    def __init__(self, block: int, num_blocks: int):
        self.block = block
        self.used = [0] * num_blocks  # rows taken in each block

    @classmethod
    def for_budget(cls, tiling: Tiling, max_num_batched_tokens: int) -> "BlockPacking":
        """The blocks of a step of at most `max_num_batched_tokens` rows (one short block
        when the budget is less than a block)."""
        B = tiling.tile
        if max_num_batched_tokens < B:
            return cls(max_num_batched_tokens, 1)
        return cls(B, max_num_batched_tokens // B)

    def add(self, n: int) -> int | None:
        """The first row of `n` rows in the first block with room, or None."""
        for i, used in enumerate(self.used):
            if used + n <= self.block:
                self.used[i] = used + n
                return i * self.block + used
        return None

    def end(self) -> int:
        """One past the last row placed: the step's rows before padding to a bucket."""
        last = max((i for i, u in enumerate(self.used) if u), default=0)
        return last * self.block + self.used[last]


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """`ops.attention` of a pooling step (models/parallel.py ParallelOps): bidirectional for
    encoders, causal for a decoder used as an embedding or classification model."""

    causal: bool
    tiling: Tiling | None = None  # None: the whole step is one block
    mesh = None  # one device: ParallelOps runs its plain, unsharded ops

    def __call__(self, q_TNH, k_TKH, v_TKH, kv, md: PoolingMetadata, *, sm_scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        T, N, H = q_TNH.shape
        group = N // k_TKH.shape[1]
        k_TNH = jnp.repeat(k_TKH, group, axis=1)
        v_TNH = jnp.repeat(v_TKH, group, axis=1)
        # A step of more than one block: the rows were packed so that no prompt crosses a
        # block edge (BlockPacking); a top bucket that is no multiple of B gets padding rows.
        B = self.tiling.tile if self.tiling is not None and T > self.tiling.tile else T
        G = -(-T // B)
        seq_ids, positions = md.seq_ids, md.positions
        if G * B != T:
            rows = ((0, G * B - T),)
            q_TNH, k_TNH, v_TNH = (jnp.pad(x, rows + ((0, 0), (0, 0)))
                                   for x in (q_TNH, k_TNH, v_TNH))
            seq_ids = jnp.pad(seq_ids, rows, constant_values=-1)
            positions = jnp.pad(positions, rows)
        # Heads lead ([G, N, B, H]): XLA:CPU then runs each product as one batched GEMM (with
        # the heads second it transposed inside the dot: several times slower, measured).
        q_GNBH, k_GNBH, v_GNBH = (x.reshape(G, B, N, H).transpose(0, 2, 1, 3)
                                  for x in (q_TNH, k_TNH, v_TNH))
        # float32 scores and softmax whatever the weights' dtype (HF's eager attention too).
        s_GNBC = jnp.einsum("gnbh,gnch->gnbc", q_GNBH, k_GNBH,
                            preferred_element_type=jnp.float32) * sm_scale
        if logits_soft_cap is not None:
            s_GNBC = logits_soft_cap * jnp.tanh(s_GNBC / logits_soft_cap)
        seq_GB = seq_ids.reshape(G, B)
        mask_GBC = seq_GB[:, :, None] == seq_GB[:, None, :]
        if self.causal:
            pos_GB = positions.reshape(G, B)
            rel_GBC = pos_GB[:, :, None] - pos_GB[:, None, :]
            mask_GBC &= rel_GBC >= 0
            if sliding_window is not None:
                mask_GBC &= rel_GBC < sliding_window
        s_GNBC = jnp.where(mask_GBC[:, None], s_GNBC, -jnp.inf)
        # softmax with the sum divided out after the product ([G, N, B, H], not [.., B, C]);
        # every row sees itself, so the max is finite.
        e_GNBC = jnp.exp(s_GNBC - s_GNBC.max(-1, keepdims=True))
        o_GNBH = jnp.einsum("gnbc,gnch->gnbh", e_GNBC, v_GNBH.astype(jnp.float32))
        o_GNBH = o_GNBH / e_GNBC.sum(-1, keepdims=True)
        o_TNH = o_GNBH.transpose(0, 2, 1, 3).reshape(G * B, N, H)[:T]
        return o_TNH.astype(q_TNH.dtype), kv


__all__ = ["BlockPacking", "DenseAttention", "PoolingMetadata", "Tiling"]
