"""What a pooling step's model reads: packed sequences with no KV cache, and the attention that
keeps each sequence to itself.

Owns `PoolingMetadata` (the step's device inputs, one registered pytree) and `DenseAttention`,
the object a model's `ops.attention` calls in a pooling step: scores over the whole packed
step [T, T], masked to the row's own sequence (and to earlier positions when causal), in
float32. Never touches a KV cache: the `kv` argument passes through untouched (a pooling step
has none), and there is no prefix to reuse.

Letters: T packed tokens (a bucket), S sequences (a bucket), N query heads, K kv heads,
H head dim, G tiles of B rows, C keys a tile's queries score.

    tokens  | a a a a | b b | c c c | pad pad |      seq_ids  0 0 0 0 1 1 2 2 2 S S
    a row of `b` sees the two `b` columns only; padding rows see padding only (never NaN).

Tiles. Scores over the whole step cost T * T per head where the prompts need only the sum of
their squares. So the rows are cut into tiles of B, and a tile's queries score only the keys
of the r tiles on either side and its own: no prompt is longer than L = max_model_len, so two
rows of one prompt are at most L - 1 apart, and r = ceil((L - 1) / B) tiles reach every key
(C = (2r + 1) * B keys per query instead of T). `Tiling.for_max_model_len` picks the B that
makes C smallest; a step runs tiled only where C < T.

    B = 32, L = 64 (r = 2):  | t0 | t1 | t2 | t3 | t4 | t5 |   queries of t3 score t1 .. t5
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
    """B rows per tile, r tiles reached on either side (static: part of the step)."""

    tile: int
    reach: int

    @classmethod
    def for_max_model_len(cls, max_model_len: int, smallest: int = 32) -> "Tiling":
        """The power-of-two B >= `smallest` (thinner tiles multiply poorly on a CPU) with the
        fewest keys per query, C = (2r + 1) * B; of equals, the larger B."""
        best = None
        B = smallest
        while True:
            reach = max(1, -(-(max_model_len - 1) // B))
            keys = (2 * reach + 1) * B
            if best is None or keys <= best[0]:
                best = (keys, cls(B, reach))
            if B >= max_model_len:
                return best[1]
            B *= 2

    def keys_per_query(self) -> int:
        return (2 * self.reach + 1) * self.tile


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """`ops.attention` of a pooling step (models/parallel.py ParallelOps): bidirectional for
    encoders, causal for a decoder used as an embedding or classification model."""

    causal: bool
    tiling: Tiling | None = None  # None: never tiled
    mesh = None  # one device: ParallelOps runs its plain, unsharded ops

    def __call__(self, q_TNH, k_TKH, v_TKH, kv, md: PoolingMetadata, *, sm_scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        T, N, H = q_TNH.shape
        group = N // k_TKH.shape[1]
        k_TNH = jnp.repeat(k_TKH, group, axis=1)
        v_TNH = jnp.repeat(v_TKH, group, axis=1)
        t = self.tiling
        # (a budget that is no power of two runs its top bucket untiled)
        tiled = t is not None and t.keys_per_query() < T and T % t.tile == 0
        B, r = (t.tile, t.reach) if tiled else (T, 0)
        G = T // B  # G tiles of B query rows, each scoring C = (2r + 1) * B keys

        def keys(x, fill):  # [T, ...] -> [G, C, ...]: each tile's neighbourhood
            if G == 1:
                return x[None]
            pad = jnp.full((r * B,) + x.shape[1:], fill, x.dtype)
            xp = jnp.concatenate([pad, x, pad])
            return jnp.concatenate([xp[i * B:(i + G) * B].reshape((G, B) + x.shape[1:])
                                    for i in range(2 * r + 1)], axis=1)

        q_GBNH = q_TNH.reshape(G, B, N, H)
        # float32 scores and softmax whatever the weights' dtype (HF's eager attention too).
        s_GNBC = jnp.einsum("gbnh,gcnh->gnbc", q_GBNH, keys(k_TNH, 0),
                            preferred_element_type=jnp.float32) * sm_scale
        if logits_soft_cap is not None:
            s_GNBC = logits_soft_cap * jnp.tanh(s_GNBC / logits_soft_cap)
        mask_GBC = md.seq_ids.reshape(G, B)[:, :, None] == keys(md.seq_ids, -1)[:, None, :]
        if self.causal:
            rel_GBC = (md.positions.reshape(G, B)[:, :, None]
                       - keys(md.positions, 0)[:, None, :])
            mask_GBC &= rel_GBC >= 0
            if sliding_window is not None:
                mask_GBC &= rel_GBC < sliding_window
        s_GNBC = jnp.where(mask_GBC[:, None], s_GNBC, -jnp.inf)
        p_GNBC = jax.nn.softmax(s_GNBC, axis=-1)
        o_GBNH = jnp.einsum("gnbc,gcnh->gbnh", p_GNBC, keys(v_TNH, 0).astype(jnp.float32))
        return o_GBNH.reshape(T, N, H).astype(q_TNH.dtype), kv


__all__ = ["DenseAttention", "PoolingMetadata", "Tiling"]
