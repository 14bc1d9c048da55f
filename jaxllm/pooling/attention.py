"""What a pooling step's model reads: packed sequences with no KV cache, and the attention that
keeps each sequence to itself.

Owns `PoolingMetadata` (the step's device inputs, one registered pytree) and `DenseAttention`,
the object a model's `ops.attention` calls in a pooling step: scores over the whole packed
step [T, T], masked to the row's own sequence (and to earlier positions when causal), in
float32. Never touches a KV cache: the `kv` argument passes through untouched (a pooling step
has none), and there is no prefix to reuse.

Letters: T packed tokens (a bucket), S sequences (a bucket), N query heads, K kv heads,
H head dim.

    tokens  | a a a a | b b | c c c | pad pad |      seq_ids  0 0 0 0 1 1 2 2 2 S S
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
class DenseAttention:
    """`ops.attention` of a pooling step (models/parallel.py ParallelOps): bidirectional for
    encoders, causal for a decoder used as an embedding or classification model."""

    causal: bool
    mesh = None  # one device: ParallelOps runs its plain, unsharded ops

    def __call__(self, q_TNH, k_TKH, v_TKH, kv, md: PoolingMetadata, *, sm_scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        T, N, H = q_TNH.shape
        group = N // k_TKH.shape[1]
        k_TNH = jnp.repeat(k_TKH, group, axis=1)
        v_TNH = jnp.repeat(v_TKH, group, axis=1)
        # float32 scores and softmax whatever the weights' dtype (HF's eager attention too).
        s_NTT = jnp.einsum("tnh,snh->nts", q_TNH, k_TNH,
                           preferred_element_type=jnp.float32) * sm_scale
        if logits_soft_cap is not None:
            s_NTT = logits_soft_cap * jnp.tanh(s_NTT / logits_soft_cap)
        mask_TT = md.seq_ids[:, None] == md.seq_ids[None, :]
        if self.causal:
            rel_TT = md.positions[:, None] - md.positions[None, :]
            mask_TT &= rel_TT >= 0
            if sliding_window is not None:
                mask_TT &= rel_TT < sliding_window
        s_NTT = jnp.where(mask_TT[None], s_NTT, -jnp.inf)
        p_NTT = jax.nn.softmax(s_NTT, axis=-1)
        o_TNH = jnp.einsum("nts,snh->tnh", p_NTT, v_TNH.astype(jnp.float32))
        return o_TNH.astype(q_TNH.dtype), kv


__all__ = ["DenseAttention", "PoolingMetadata"]
