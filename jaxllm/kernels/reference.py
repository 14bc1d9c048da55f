"""Pure-XLA ragged paged attention: the simple reference the kernels mirror, not a backend.

Owns: the plainest correct statement of attention of a packed ragged batch of new query tokens
over a paged KV cache. Backend "xla" (the CPU path) is kernels/xla_attention.py; this file
stays short and obviously right, and its cost follows the padded block-table width.
Must never: let a cache slot the query may not see (past it, or before its window) reach the
arithmetic unselected (such slots may hold NaN), or depend on anything past `num_seqs` /
`query_start_loc[num_seqs]`.

Packed layout (T padded to a bucket, S padded to a bucket):

    q rows:  | seq 0: 5 new tokens | seq 1: 1 | seq 2: 3 |  padding ... |
    qsl:     0                     5         6         9 = qsl[num_seqs]
    seq 0 with seq_lens[0] = 12 has 7 cached tokens; its new tokens sit at positions 7..11.

Options (keyword-only, static Python values, the same in every kernel):
  sliding_window W: a query at position p sees the keys j with p - W < j <= p (W keys, its own
    included; HF's and vLLM's convention). None: every key up to p.
  logits_soft_cap c: scores s = (q . k) * sm_scale become c * tanh(s / c) before the softmax
    (Gemma 2's attn_logit_softcapping). None: no cap.

Each token gathers its own sequence's pages (t -> s(t) -> block_tables[s]), so the cost is
that of the score matmul itself; tokens are processed in chunks to bound the gathered K/V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Letters: T tokens, S seqs, N query heads, K kv heads, G = N // K, H head dim,
# B blocks per seq, P block size, L = B * P key positions.
_TOKEN_CHUNK = 32


def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           num_seqs, *, sm_scale, sliding_window=None, logits_soft_cap=None):
    T, N, H = q.shape
    _, P, K, _ = k_cache.shape
    S, B = block_tables.shape
    G = N // K
    L = B * P

    t_idx = jnp.arange(T, dtype=jnp.int32)  # [T]
    seq_valid = jnp.arange(S, dtype=jnp.int32) < num_seqs  # [S]
    # s(t): number of real sequences whose query range ends at or before t.
    ends = query_start_loc[1:]  # [S]
    seq_of_t = jnp.sum((ends[None, :] <= t_idx[:, None]) & seq_valid[None, :], axis=1)  # [T]
    seq_of_t = jnp.minimum(seq_of_t, S - 1).astype(jnp.int32)
    token_valid = t_idx < query_start_loc[num_seqs]  # [T]
    q_len = query_start_loc[seq_of_t + 1] - query_start_loc[seq_of_t]  # [T]
    pos = seq_lens[seq_of_t] - q_len + (t_idx - query_start_loc[seq_of_t])  # [T]

    q_TKGH = q.reshape(T, K, G, H)

    def one_token(q_KGH, s, p, valid):
        pages = block_tables[s]  # [B]
        k_LKH = k_cache[pages].reshape(L, K, H)
        v_LKH = v_cache[pages].reshape(L, K, H)
        j = jnp.arange(L)
        visible = (j <= p) & valid  # [L]
        if sliding_window is not None:
            visible &= j > p - sliding_window
        # Scores in f32 whatever the cache dtype; masked slots may hold NaN, so select
        # (never multiply) both the scores and the values.
        s_KGL = jnp.einsum("kgh,lkh->kgl", q_KGH.astype(jnp.float32),
                           k_LKH.astype(jnp.float32)) * sm_scale
        if logits_soft_cap is not None:
            s_KGL = logits_soft_cap * jnp.tanh(s_KGL / logits_soft_cap)
        s_KGL = jnp.where(visible[None, None, :], s_KGL, -jnp.inf)
        m_KG1 = jnp.max(s_KGL, axis=-1, keepdims=True)
        m_KG1 = jnp.where(jnp.isfinite(m_KG1), m_KG1, 0.0)
        p_KGL = jnp.exp(s_KGL - m_KG1)
        denom_KG1 = jnp.sum(p_KGL, axis=-1, keepdims=True)
        v_LKH = jnp.where(visible[:, None, None], v_LKH.astype(jnp.float32), 0.0)
        o_KGH = jnp.einsum("kgl,lkh->kgh", p_KGL, v_LKH)
        o_KGH = o_KGH / jnp.where(denom_KG1 > 0, denom_KG1, 1.0)
        return jnp.where(valid, o_KGH, 0.0)

    out_TKGH = jax.lax.map(lambda a: one_token(*a), (q_TKGH, seq_of_t, pos, token_valid),
                           batch_size=min(T, _TOKEN_CHUNK))
    return out_TKGH.reshape(T, N, H).astype(q.dtype)
