"""XLA ragged paged attention whose cost follows each sequence's real context (backend "xla").

Owns: attention of a packed ragged batch over the paged KV cache on CPU, with work in
proportion to each sequence's own length -- never to the padded block-table width W, nor to the
longest sequence of the batch. Same signature and semantics as kernels/reference.py.
Must never: let a cache slot invisible to a row (past it, or before its sliding window; it may
hold NaN) reach the arithmetic unselected; loop over chunks wholly before a window; read
anything of sequences past `num_seqs` or rows past `query_start_loc[num_seqs]`; fold the
kv-head axis K into another axis (tensor parallelism shards K, and the SPMD partitioner must
see it as a plain batch axis).

Work decomposition. A sequence with q_len <= DECODE_MAX_Q is "decode-like": each of its rows
reads the keys up to its own position. The others are "prefill": their rows are cut into tiles
of PREFILL_TILE rows that share one read of the keys.

    decode rows: one flat list of (row, chunk of DECODE_CHUNK keys) items, DECODE_ITEMS (R) per
    loop iteration, so a 2000-token row next to 100-token rows costs its own chunks only
    (R = 4 in this picture):

      row 0 (600 keys)   row 1 (100)   row 2 (1200)
      [c0][c1][c2]       [c0]          [c0][c1][c2][c3][c4]
      |-- iteration 0: items 0..3 --|-- iteration 1: items 4..7 --|-- it 2: 8, pad --|

    Each iteration computes a partial softmax (max m, sum l, unnormalised o) per item and folds
    the items into a per-row accumulator through a one-hot [R x R] combine over the window of
    R rows starting at its first item's row (R consecutive items touch at most R rows).

    prefill tiles: an outer loop over tiles, an inner loop over PREFILL_CHUNK-key chunks up to
    the tile's last position, with an online softmax carried across chunks:

      80 new rows after 200 cached:  tile rows  0..63: keys [0, 264)  2 chunks of 256
                                     tile rows 64..79: keys [0, 280)  2 chunks

With a sliding window a row at position p reads only the chunks from the one holding key
max(0, p - sliding_window + 1): a decode row's item list starts at its window's first chunk, a
prefill tile's key loop at the chunk of its first row's window, so work follows
min(context, sliding_window). The
logit soft cap is applied to each chunk's scores before the softmax.

All trip counts are computed on the device from seq_lens / query_start_loc / num_seqs, so the
signature is the reference's. Padding items of a last iteration read one visible row.

XLA:CPU facts that shaped this file (each found by timing variants, see
benchmarks/attention_bench.py):
  * A gather whose fusion root is the gather itself is emitted one float at a time; with an
    arithmetic root (the softmax scale on K, a runtime 1 on V) the loop is vectorised.
  * Slot indices computed inside the gather fusion are recomputed per element: they are
    computed one iteration ahead and carried, so the gather reads them from memory.
  * Inside a while loop XLA:CPU converts a bf16 gather operand -- the whole cache -- to f32 and
    hoists that out of the loop (a full-cache copy per call). Gathering under a `lax.cond` keeps
    the conversion inside the gather fusion, on the gathered rows only.
  * The kv-head axis leads every per-chunk array ([K, ..., C, H]) so the dots batch over
    leading axes with no transposes, and the gathers use K as a batching axis (which the SPMD
    partitioner splits with no collective).
Dots take f32 operands (widened in the gather fusion) with f32 accumulation: XLA:CPU's bf16
dots and elementwise code are slower than f32 here. The softmax is f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Letters: T rows, S seqs, N query heads, K kv heads, G = N // K, H head dim, P block size,
# C keys per chunk, R items per decode iteration, J accumulator rows of an iteration's window,
# Q rows per prefill tile, M = Q * G query vectors per kv head, W block-table width.

# A 64-row tile step over 256 keys costs about as much as 7 single-row steps (0.31 ms vs
# 46 us, f32), so sequences with up to 8 new rows read their keys once per row.
DECODE_MAX_Q = 8
DECODE_CHUNK = 256    # keys per decode work item
DECODE_ITEMS = 8      # decode work items per loop iteration
PREFILL_TILE = 64     # rows per prefill tile
PREFILL_CHUNK = 256   # keys per prefill inner-loop step


def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           num_seqs, *, sm_scale, sliding_window=None, logits_soft_cap=None,
                           decode_chunk=DECODE_CHUNK, decode_items=DECODE_ITEMS,
                           prefill_tile=PREFILL_TILE, prefill_chunk=PREFILL_CHUNK):
    """Same signature and semantics as kernels/reference.py (the decode_* / prefill_*
    keywords tune the work decomposition only)."""
    T, S = q.shape[0], block_tables.shape[0]
    seq_ok = jnp.arange(S, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(seq_ok, query_start_loc[1:] - query_start_loc[:-1], 0)  # [S]
    # Row ranges of padding sequences are garbage: they end at "never".
    ends = jnp.where(seq_ok, query_start_loc[1:], jnp.iinfo(jnp.int32).max)  # [S]
    is_decode = q_lens <= DECODE_MAX_Q

    cache = _Cache(k_cache, v_cache, block_tables, sm_scale, q.dtype, sliding_window,
                   logits_soft_cap)
    q_TNH = q.astype(jnp.float32)
    out_TNH = _decode_rows(cache, q_TNH, seq_lens, query_start_loc, ends,
                           jnp.where(is_decode, q_lens, 0), chunk=decode_chunk,
                           items=decode_items)
    out_TNH = out_TNH + _prefill_tiles(cache, q_TNH, seq_lens, query_start_loc,
                                       jnp.where(is_decode, 0, q_lens),
                                       tile=min(prefill_tile, T), chunk=prefill_chunk)
    return out_TNH.astype(q.dtype)


class _Cache:
    """The paged caches [B blocks, P, K, H] and the gather of a chunk of their slots.

    Slots are addressed as (block, offset) pairs, never as flat rows of a [B * P, K, H]
    reshape: when a device holds one KV head (K = 1: MQA, or tensor parallelism with
    tp = num_kv_heads) XLA:CPU lays such a reshape out differently from the cache and copies
    the whole cache to convert it, on every call."""

    def __init__(self, k_cache, v_cache, block_tables, sm_scale, q_dtype, window, soft_cap):
        P = k_cache.shape[1]
        # A uint16 cache holds q_dtype (16-bit float) bits: the engine stores bf16 caches so
        # on CPU, where XLA has no bf16 scatter (models/layers.py kv_storage_dtype).
        self.bits_of = q_dtype if k_cache.dtype == jnp.uint16 else None
        self.k_cache, self.v_cache = k_cache, v_cache
        self.block_size, self.sm_scale = P, sm_scale
        self.block_tables = block_tables
        self.window, self.soft_cap = window, soft_cap

    def first_key(self, pos):
        """The first key position a query at `pos` sees (0 without a sliding window)."""
        if self.window is None:
            return jnp.zeros_like(pos)
        return jnp.maximum(pos - self.window + 1, 0)

    def visible(self, kpos, pos):
        """Whether the key at `kpos` is visible to the query at `pos` (broadcasting)."""
        vis = kpos <= pos
        if self.window is not None:
            vis &= kpos > pos - self.window
        return vis

    def slots(self, seq, kpos):
        """[..., 2] int32 (block, offset) of key position `kpos` of sequence `seq`
        (broadcasting int32 arrays); positions past the block table read entry 0 (callers
        mask them)."""
        W = self.block_tables.shape[1]
        page = kpos // self.block_size
        entry = self.block_tables[seq, jnp.minimum(page, W - 1)]
        block = jnp.where(page < W, entry, 0)
        return jnp.stack(jnp.broadcast_arrays(block, kpos % self.block_size), axis=-1)

    def gather(self, slot):
        """K * sm_scale and V at `slot` [..., C, 2] -> two f32 [K, ..., C, H]."""
        def rows(slot):
            # Arithmetic roots vectorise the gather loops (see the module notes).
            one = (slot.reshape(-1)[0] >= 0).astype(jnp.float32)
            k = self._floats(_gather_rows(self.k_cache, slot)) * self.sm_scale
            v = self._floats(_gather_rows(self.v_cache, slot)) * one
            return k, v

        # Always true, but not provably so: keeps a bf16 -> f32 convert inside the branch.
        return jax.lax.cond(slot.reshape(-1)[0] >= 0, rows, _zeros_like_rows(rows), slot)


    def _floats(self, rows):
        if self.bits_of is not None:
            rows = jax.lax.bitcast_convert_type(rows, self.bits_of)
        return rows.astype(jnp.float32)


def _zeros_like_rows(fn):
    return lambda slot: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                     jax.eval_shape(fn, slot))


def _gather_rows(cache_BPKH, slot):
    """cache[block, offset] for each (block, offset) pair of `slot` [..., 2], laid out
    [K, ..., H], with K a gather batching axis."""
    K, H = cache_BPKH.shape[2:]
    idx = jnp.broadcast_to(slot[None], (K, *slot.shape))
    nd = slot.ndim - 1
    dnums = jax.lax.GatherDimensionNumbers(
        offset_dims=(nd + 1,), collapsed_slice_dims=(0, 1), start_index_map=(0, 1),
        operand_batching_dims=(2,), start_indices_batching_dims=(0,))
    return jax.lax.gather(cache_BPKH, idx, dnums, slice_sizes=(1, 1, 1, H),
                          mode="promise_in_bounds")


def _count_le(ends, x):
    """How many entries of the non-decreasing `ends` are <= each x (a small searchsorted)."""
    return jnp.sum(ends[None, :] <= x[:, None], axis=1).astype(jnp.int32)


def _softmax_part(q_KXMH, k_KXCH, v_KXCH, vis_XMC, soft_cap=None):
    """Partial softmax of queries over one chunk of keys (X: any leading item axes); the
    scores (K carries sm_scale) capped to soft_cap * tanh(s / soft_cap) when it is set.
    Returns m [K, X, M] (-inf where nothing is visible), l [K, X, M], o [K, X, M, H]."""
    if q_KXMH.shape[-2] < 16:
        # Few query rows (decode): the dot is ~2x faster with the keys as its left operand,
        # and the barrier keeps XLA from folding the transpose back into the dot; the
        # softmax then runs with the keys on the minor (vectorised) axis.
        s = jnp.einsum("k...ch,k...mh->k...cm", k_KXCH, q_KXMH)
        s = jnp.swapaxes(jax.lax.optimization_barrier(s), -1, -2)
    else:
        s = jnp.einsum("k...mh,k...ch->k...mc", q_KXMH, k_KXCH)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(vis_XMC[None], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis_XMC[None], jnp.exp(s - m_safe[..., None]), 0.0)
    o = jnp.einsum("k...mc,k...ch->k...mh", p, v_KXCH)
    return m, jnp.sum(p, axis=-1), o


def _decode_rows(cache, q_TNH, seq_lens, query_start_loc, ends, q_lens, *, chunk, items):
    """Rows of the sequences with q_lens > 0, each reading its own keys; f32 [T, N, H], zero
    elsewhere."""
    T, N, H = q_TNH.shape
    K = cache.k_cache.shape[2]
    G, C, R = N // K, chunk, items
    S = q_lens.shape[0]
    t_ids = jnp.arange(T, dtype=jnp.int32)

    # Rows of this path, compacted: row_rank u -> (row, seq, position).
    row_seq = jnp.minimum(_count_le(ends, t_ids), S - 1)  # [T]
    in_seq = t_ids - query_start_loc[row_seq]
    row_ok = (in_seq >= 0) & (in_seq < q_lens[row_seq])  # [T]
    rank = jnp.cumsum(row_ok.astype(jnp.int32)) - 1  # [T] rank of an in-path row
    num_rows = rank[-1] + 1
    # The u-th in-path row is the first t with rank[t] == u (rank is non-decreasing).
    u_row = jnp.minimum(jnp.searchsorted(rank, t_ids, side="left"), T - 1).astype(jnp.int32)
    u_seq = row_seq[u_row]
    u_pos = seq_lens[u_seq] - q_lens[u_seq] + in_seq[u_row]  # [T] position of the u-th row
    u_ok = t_ids < num_rows
    # A row's chunks run from its window's first chunk to its own: nothing before is read.
    u_lo = cache.first_key(u_pos)  # [T] first visible key of the u-th row
    u_chunks = jnp.where(u_ok, u_pos // C + 1 - u_lo // C, 0)
    item_end = jnp.cumsum(u_chunks).astype(jnp.int32)  # [T]
    num_items = item_end[-1]

    def plan(it):
        """Items of iteration `it`, one iteration ahead (carried), so the gathers read
        materialised slot indices."""
        i_R = it * R + jnp.arange(R, dtype=jnp.int32)
        item_ok = i_R < num_items
        u_R = jnp.minimum(_count_le(item_end, i_R), T - 1)
        c_R = u_lo[u_R] // C + i_R - (item_end[u_R] - u_chunks[u_R])
        kpos_RC = c_R[:, None] * C + jnp.arange(C, dtype=jnp.int32)
        vis_RC = cache.visible(kpos_RC, u_pos[u_R][:, None]) & item_ok[:, None]
        slot_RC = cache.slots(u_seq[u_R][:, None], kpos_RC)
        # Invisible slots may hold NaN and NaN * 0 is NaN in the P @ V dot: read the first
        # visible key of the iteration's first item (always a real one) instead.
        kpos0 = jnp.maximum(c_R[0] * C, u_lo[u_R[0]])
        slot_RC = jnp.where(vis_RC[..., None], slot_RC, cache.slots(u_seq[u_R[0]], kpos0))
        return dict(u=u_R, item_ok=item_ok, slot=slot_RC, vis=vis_RC)

    def body(it, carry):
        (acc_o, acc_m, acc_l), cur = carry
        u_R, item_ok = cur["u"], cur["item_ok"]
        q_KRGH = q_TNH[u_row[u_R]].reshape(R, K, G, H).transpose(1, 0, 2, 3)
        k, v = cache.gather(cur["slot"])  # [K, R, C, H]
        vis_RGC = jnp.broadcast_to(cur["vis"][:, None, :], (R, G, C))
        m_KRG, l_KRG, o_KRGH = _softmax_part(q_KRGH, k, v, vis_RGC, cache.soft_cap)
        m_RN = m_KRG.transpose(1, 0, 2).reshape(R, N)
        l_RN = l_KRG.transpose(1, 0, 2).reshape(R, N)
        o_RNH = o_KRGH.transpose(1, 0, 2, 3).reshape(R, N, H)
        # Fold the R items into accumulator rows u0 .. u0 + R - 1 (J: window rows).
        u0 = u_R[0]
        hit_JR = (u_R[None, :] - u0 == jnp.arange(R)[:, None]) & item_ok[None, :]
        win_o = jax.lax.dynamic_slice_in_dim(acc_o, u0, R)  # [J, N, H]
        win_m = jax.lax.dynamic_slice_in_dim(acc_m, u0, R)  # [J, N]
        win_l = jax.lax.dynamic_slice_in_dim(acc_l, u0, R)
        part_m = jnp.where(hit_JR[..., None], m_RN[None], -jnp.inf)  # [J, R, N]
        new_m = jnp.maximum(win_m, jnp.max(part_m, axis=1))
        new_safe = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
        w_JRN = jnp.where(hit_JR[..., None], jnp.exp(part_m - new_safe[:, None]), 0.0)
        keep_JN = jnp.exp(win_m - new_safe)  # 0 where nothing was accumulated yet
        new_o = keep_JN[..., None] * win_o + jnp.einsum("jrn,rnh->jnh", w_JRN, o_RNH)
        new_l = keep_JN * win_l + jnp.einsum("jrn,rn->jn", w_JRN, l_RN)
        acc = (jax.lax.dynamic_update_slice_in_dim(acc_o, new_o, u0, 0),
               jax.lax.dynamic_update_slice_in_dim(acc_m, new_m, u0, 0),
               jax.lax.dynamic_update_slice_in_dim(acc_l, new_l, u0, 0))
        return acc, plan(it + 1)

    acc0 = (jnp.zeros((T + R, N, H), jnp.float32), jnp.full((T + R, N), -jnp.inf, jnp.float32),
            jnp.zeros((T + R, N), jnp.float32))
    (acc_o, _, acc_l), _ = jax.lax.fori_loop(0, (num_items + R - 1) // R, body,
                                             (acc0, plan(0)))
    r = jnp.where(row_ok, rank, 0)
    o_TNH = acc_o[r] / jnp.where(acc_l[r] > 0, acc_l[r], 1.0)[..., None]
    return jnp.where(row_ok[:, None, None], o_TNH, 0.0)


def _prefill_tiles(cache, q_TNH, seq_lens, query_start_loc, q_lens, *, tile, chunk):
    """Rows of the sequences with q_lens > 0 in tiles of `tile` rows sharing each key read;
    f32 [T, N, H], zero elsewhere."""
    T, N, H = q_TNH.shape
    K = cache.k_cache.shape[2]
    G, Q, C = N // K, tile, chunk
    M = Q * G
    S = q_lens.shape[0]
    tiles_per_seq = -(-q_lens // Q)  # [S]
    tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)
    num_tiles = tile_end[-1]

    def tile_body(u, out_TNH):
        s = jnp.minimum(_count_le(tile_end, u[None])[0], S - 1)
        j = u - (tile_end[s] - tiles_per_seq[s])  # tile index within the sequence
        row0 = query_start_loc[s] + j * Q
        rows = jnp.minimum(q_lens[s] - j * Q, Q)  # valid rows of this tile
        pos0 = seq_lens[s] - q_lens[s] + j * Q  # position of the tile's first row
        last = pos0 + rows - 1
        first = cache.first_key(pos0)  # the tile's earliest visible key
        qi = jnp.arange(Q, dtype=jnp.int32)
        row_ok_Q = qi < rows
        q_rows = jnp.minimum(row0 + qi, T - 1)
        q_KMH = q_TNH[q_rows].reshape(Q, K, G, H).transpose(1, 0, 2, 3).reshape(K, M, H)

        def chunk_body(c, state):
            m_KM, l_KM, o_KMH = state
            kpos_C = c * C + jnp.arange(C, dtype=jnp.int32)
            slot_C = cache.slots(s, kpos_C)
            # Keys no row of the tile sees (past its last row, before its first row's
            # window): read the chunk's first key that some row sees instead.
            seen_C = (kpos_C >= first) & (kpos_C <= last)
            slot_C = jnp.where(seen_C[:, None], slot_C,
                               cache.slots(s, jnp.maximum(c * C, first)))
            k, v = cache.gather(slot_C)  # [K, C, H]
            vis_QC = cache.visible(kpos_C[None, :], (pos0 + qi)[:, None]) & row_ok_Q[:, None]
            vis_MC = jnp.repeat(vis_QC, G, axis=0)
            m_c, l_c, o_c = _softmax_part(q_KMH, k, v, vis_MC, cache.soft_cap)
            new_m = jnp.maximum(m_KM, m_c)
            safe = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
            a, b = jnp.exp(m_KM - safe), jnp.exp(m_c - safe)
            return new_m, a * l_KM + b * l_c, a[..., None] * o_KMH + b[..., None] * o_c

        init = (jnp.full((K, M), -jnp.inf, jnp.float32), jnp.zeros((K, M), jnp.float32),
                jnp.zeros((K, M, H), jnp.float32))
        # From the chunk of the tile's earliest visible key: nothing before it is read.
        _, l_KM, o_KMH = jax.lax.fori_loop(first // C, last // C + 1, chunk_body, init)
        o_KMH = o_KMH / jnp.where(l_KM > 0, l_KM, 1.0)[..., None]
        o_QNH = o_KMH.reshape(K, Q, G, H).transpose(1, 0, 2, 3).reshape(Q, N, H)
        old = jax.lax.dynamic_slice_in_dim(out_TNH, row0, Q)
        new = jnp.where(row_ok_Q[:, None, None], o_QNH, old)
        return jax.lax.dynamic_update_slice_in_dim(out_TNH, new, row0, 0)

    # Q spare rows so a tile's window never runs past the end (a clamped slice would shift).
    out_TNH = jax.lax.fori_loop(0, num_tiles, tile_body, jnp.zeros((T + Q, N, H), jnp.float32))
    return out_TNH[:T]
