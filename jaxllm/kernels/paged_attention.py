"""Pallas (Triton) ragged paged attention: prefill chunks, chunks over a cached prefix and
decode tokens of many sequences, in one kernel launch.

Owns: attention of a packed ragged batch of new query tokens over a paged KV cache on GPUs
(A100/H100 through the Pallas Triton backend), and its CPU run under the Pallas interpreter.
Must never: let an unused, not-yet-visible or before-the-window cache slot reach the output
(such slots may hold NaN, so K and V loads are masked, not only the scores); loop over key
chunks wholly before a tile's sliding window; write outside its output rows.
The pure-XLA version with the same signature is `jaxllm/kernels/reference.py`.

Letters: T packed tokens, S sequences (bucket), Hq query heads, Hkv kv heads, G = Hq // Hkv,
D head dim, Q = BLOCK_M // G query tokens per tile.

Tile rows. The G query heads that share a KV head are packed with the tokens into the rows of
one tile, so even a single decode token is a tensor-core matmul (>= 16 rows), and each K/V
chunk is read once per KV head, not once per query head:

    tile rows (BLOCK_M = 16, G = 4 -> Q = 4 tokens per tile; h = kv_head * G + g):
      row r:    0   1   2   3 |  4   5   6   7 |  8 ..  11 | 12 ..  15
      token:    j0            |  j0+1          |  j0+2     |  j0+3
      head g:   0   1   2   3 |  0   1   2   3 |  0 ..   3 |  0 ..   3
    (when G does not divide BLOCK_M the last BLOCK_M % G rows are idle)

Grid. Axis 0 walks query tiles with a static bound cdiv(T, Q) + S (enough: first(num_seqs)
+ cdiv(T - qsl[num_seqs], Q) <= cdiv(T, Q) + num_seqs); axis 1 is the KV head;
the split-KV variant adds axis 2, a slice of the key range. Sequence s owns programs
[first(s), first(s + 1)) where first(s) = qsl[s] // Q + s; it needs only ceil(q_len_s / Q)
of them, the rest exit at once ("holes"). Programs from first(num_seqs) on write zeros over
the padding rows [qsl[num_seqs], T). Example, Q = 4, T = 16, S = 4, num_seqs = 3
(grid axis 0 = cdiv(16, 4) + 4 = 8 programs):

    packed q rows:  | seq 0: 6 tokens  |s1| seq 2: 5 tokens |pad|
    qsl:            0                  6  7               12  16
    first(s):       0                  2  3                6 = first(num_seqs)
    program p:      0     1     2        3     4     5     6           7
    work:           s0    s0    s1       s2    s2    hole  pad         pad (rows >= T:
                    j0=0  j0=4  j0=0     j0=0  j0=4        rows 12..15  none, so idle)

    (program 2 holds s1's single token; program 5 is s2's spare slot.)
    A program finds its sequence by binary search over first(0..num_seqs); this needs
    qsl[0] == 0 and qsl non-decreasing, as the runner builds it.

Keys. Query token j of sequence s is at position ctx_s + j, ctx_s = seq_lens[s] - q_len_s.
A tile covering tokens j0 .. j0 + Q - 1 reads keys [0, ctx_s + min(j0 + Q, q_len_s)) in
chunks of BLOCK_N; chunks wholly below position ctx_s + j0 are visible to every row and skip
all masking; the rest ("diagonal" chunks) mask loads past the sequence and causal scores:

    keys:   0 ............................ ctx+j0 ........ ctx+j0+Q-1
            [ chunk ][ chunk ][ chunk ][ diag chunk ][ diag chunk ]
            <------ unmasked loop ------><------- masked loop ------>

Sliding window W (static; kernels/reference.py): a row at position p sees keys (p - W, p].
A tile's chunks then start at the one holding its first row's earliest key, kv_start =
max(0, ctx + j0 - W + 1), and the chunks that straddle the window's lower edge for some row
are masked too (loads below kv_start, scores outside each row's window):

    keys:   0 ... kv_start ......... kv_end-W ........ ctx+j0 ........ kv_end
                  [ edge chunk ][ chunk ][ chunk ][ diag chunk ][ diag chunk ]
            never  <- masked  -><-- unmasked loop --><------ masked ------->
    (the two masked ranges are one loop that skips the unmasked chunks)

Logit soft cap c (static): the scores s = q.k * sm_scale become c * tanh(s / c) before the
softmax (in base e, then scaled to base 2 like the uncapped ones).

Split-KV. With few tiles (decode of a few long sequences) axis 2 splits each tile's chunks
into `num_kv_splits` contiguous slices; each program writes its slice's normalized partial
output and base-2 log-sum-exp, and a small XLA epilogue merges them. The public function
chooses plain or split from static shapes (`jaxllm/kernels/tuning.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.kernels import tuning as tuning_lib

# A finite "minus infinity": exp2(_MASK - m) underflows to 0 for any real score m, and, unlike
# -inf, _MASK - _MASK is 0, not NaN.
_MASK = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)
_TUNING_KEYS = frozenset({"target", "block_m", "block_n", "num_warps", "num_stages",
                          "num_kv_splits"})


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body needs to know as Python numbers."""
    block_m: int
    block_n: int
    group: int  # G query heads per KV head
    q_tile: int  # Q query tokens per tile
    num_q_heads: int
    num_tokens: int  # T
    block_size: int
    search_steps: int  # binary-search iterations to find a program's sequence
    num_splits: int
    scale_log2: float  # sm_scale * log2(e): scores live in base 2
    sm_scale: float
    sliding_window: int | None  # keys a row sees, its own included; None: all before it
    logits_soft_cap: float | None  # c in c * tanh(s / c); None: no cap
    precision: lax.Precision | lax.DotAlgorithmPreset | None  # f32 only, see _f32_precision


# ----------------------------------------------------------------------------- kernel body


def _find_seq(qsl_ref, p, num_seqs, st: _Static):
    """Largest s < num_seqs with first(s) <= p, first(s) = qsl[s] // Q + s."""

    def step(_, lo_hi):
        lo, hi = lo_hi  # invariant: first(lo) <= p < first(hi), or hi == lo + 1
        mid = (lo + hi) // 2
        go_right = qsl_ref[mid] // st.q_tile + mid <= p
        return jnp.where(go_right, mid, lo), jnp.where(go_right, hi, mid)

    lo, _ = lax.fori_loop(0, st.search_steps, step, (jnp.int32(0), num_seqs))
    return lo


def _scores(q, k, st: _Static):
    """q . k in base 2: scaled by sm_scale, capped when a soft cap is set. [BM, BN] f32."""
    dots = plgpu.dot(q, k, trans_b=True, precision=st.precision)
    if st.logits_soft_cap is None:
        return dots * st.scale_log2
    # c * tanh(x) as c * (1 - 2 / (e^(2x) + 1)): exp2 and a division, where libdevice's tanhf
    # made the windowed A100 decode tile spill registers. Absolute error ~c * 6e-8 near x = 0
    # (1 - (1 - x)), far below the f32 tolerance; saturates to +-c, never NaN.
    c = st.logits_soft_cap
    e = jnp.exp2(dots * (2.0 * _LOG2E * st.sm_scale / c))
    return (1.0 - 2.0 / (e + 1.0)) * (c * _LOG2E)


def _attend_chunks(c_lo, c_hi, carry, *, masked, s, kvh, q, pos, kv_start, kv_end, bt_ref,
                   k_ref, v_ref, st: _Static, skip=None):
    """Online softmax over key chunks [c_lo, c_hi) of sequence s (carry: acc, m, l).
    skip (a, b): leave out chunks [a, b), i.e. visit [c_lo, a) and [b, c_hi) in one loop (one
    loop, not two: a third pipelined loop spills registers on the A100)."""
    bn, bs, d = st.block_n, st.block_size, q.shape[1]
    # Every index is an integer array (no `:` slices): the Pallas interpreter gathers only
    # such all-array indexers, and Triton builds the same pointer tensor either way.
    cols = lax.iota(jnp.int32, d)[None, :]  # [1, D]

    def body(i, carry):
        c = i if skip is None else jnp.where(i < skip[0], i, i + (skip[1] - skip[0]))
        acc, m, l = carry  # [BM, D] f32, [BM] f32, [BM] f32
        kv = c * bn + lax.iota(jnp.int32, bn)  # [BN] key positions
        if masked:
            kv_ok = (kv >= kv_start) & (kv < kv_end)  # [BN]
            page = plgpu.load(bt_ref.at[s, kv // bs], mask=kv_ok, other=0)  # [BN]
            slot = page * bs + kv % bs
            kv_ok_2d = jnp.broadcast_to(kv_ok[:, None], (bn, d))
            # Masked loads never touch slots past the sequence or before the tile's window:
            # they may hold NaN (or belong to a freed page).
            k = plgpu.load(k_ref.at[slot[:, None], kvh, cols], mask=kv_ok_2d, other=0)  # [BN, D]
            v = plgpu.load(v_ref.at[slot[:, None], kvh, cols], mask=kv_ok_2d, other=0)  # [BN, D]
        else:
            page = bt_ref[s, kv // bs]
            slot = page * bs + kv % bs
            k = k_ref[slot[:, None], kvh, cols]
            v = v_ref[slot[:, None], kvh, cols]
        scores = _scores(q, k, st)
        if masked:
            visible = kv[None, :] <= pos[:, None]  # [BM, BN] causal; also < kv_end for real rows
            if st.sliding_window is not None:  # and inside the row's window
                visible &= kv[None, :] > pos[:, None] - st.sliding_window
            scores = jnp.where(visible, scores, _MASK)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))  # [BM]
        alpha = jnp.exp2(m - m_new)  # [BM]
        # A row that has seen no key yet (m_new == _MASK) gets p = 1 on masked scores: its
        # acc and l are garbage but finite (masked-in-range V is visible to another row of
        # the tile, out-of-range V loads as 0), and alpha = 0 erases them at the row's first
        # visible key. Every real row sees a key (its own), and in the split grid the splits
        # with one dominate the merge (lse = _MASK + small == _MASK in the others).
        p = jnp.exp2(scores - m_new[:, None])  # [BM, BN]
        l = l * alpha + jnp.sum(p, axis=1)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=st.precision)  # [BM, D]
        return acc * alpha[:, None] + pv, m_new, l

    if skip is not None:
        c_hi = c_hi - (skip[1] - skip[0])
    return lax.fori_loop(c_lo, c_hi, body, carry)


def _kernel(num_seqs_ref, qsl_ref, seq_lens_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *lse_ref,
            st: _Static):
    # num_seqs [1]; qsl [S + 1]; seq_lens [S]; bt [S, max_blocks]; q [T * Hq, D];
    # k, v [num_blocks * block_size, Hkv, D]; plain: o [T * Hq, D];
    # split: o [splits, T * Hq, D] f32 and lse_ref = ([splits, T * Hq] f32,)
    p_id = pl.program_id(0)
    kvh = pl.program_id(1)
    split = pl.program_id(2) if st.num_splits > 1 else None
    bm, d = st.block_m, q_ref.shape[1]

    r = lax.iota(jnp.int32, bm)
    tok = r // st.group  # token within the tile, per row
    head = kvh * st.group + r % st.group  # query head, per row
    in_tile = tok < st.q_tile

    num_seqs = num_seqs_ref[0]
    q_end = qsl_ref[num_seqs]
    first_pad = q_end // st.q_tile + num_seqs

    cols = lax.iota(jnp.int32, d)[None, :]  # [1, D]

    def store(t, valid, out, lse):
        rows = t * st.num_q_heads + head  # [BM] rows of the [T * Hq, D] view
        valid_2d = jnp.broadcast_to(valid[:, None], (bm, d))
        if split is None:
            plgpu.store(o_ref.at[rows[:, None], cols], out.astype(o_ref.dtype), mask=valid_2d)
        else:
            plgpu.store(o_ref.at[split, rows[:, None], cols], out, mask=valid_2d)
            plgpu.store(lse_ref[0].at[split, rows], lse, mask=valid)

    def write_padding():
        t = q_end + (p_id - first_pad) * st.q_tile + tok
        # Merge of all-_MASK partials gives exactly 0 (equal weights, zero values).
        store(t, in_tile & (t < st.num_tokens), jnp.zeros((bm, d), jnp.float32),
              jnp.full((bm,), _MASK, jnp.float32))

    def attend(s, j0, q_start, q_len):
        seq_len = seq_lens_ref[s]
        ctx = seq_len - q_len
        j = j0 + tok  # token within the sequence, per row
        valid = in_tile & (j < q_len)
        t = q_start + j
        q = plgpu.load(q_ref.at[(t * st.num_q_heads + head)[:, None], cols],
                       mask=jnp.broadcast_to(valid[:, None], (bm, d)), other=0)  # [BM, D]
        pos = ctx + j  # [BM]
        kv_end = ctx + jnp.minimum(j0 + st.q_tile, q_len)  # keys any row of the tile may see
        n_chunks = pl.cdiv(kv_end, st.block_n)
        n_unmasked = (ctx + j0 + 1) // st.block_n  # chunks below every row's position
        if st.sliding_window is None:
            kv_start = first = w_lo = 0
        else:
            kv_start = jnp.maximum(ctx + j0 - st.sliding_window + 1, 0)  # first row's first key
            first = kv_start // st.block_n  # no chunk before it is visited
            # Chunks from w_lo on start inside the last real row's window (so every row's).
            w_lo = pl.cdiv(jnp.maximum(kv_end - st.sliding_window, 0), st.block_n)
        if split is None:
            lo, hi = first, n_chunks
        else:
            per_split = pl.cdiv(n_chunks - first, st.num_splits)
            lo = jnp.minimum(first + split * per_split, n_chunks)
            hi = jnp.minimum(lo + per_split, n_chunks)
        carry = (jnp.zeros((bm, d), jnp.float32), jnp.full((bm,), _MASK, jnp.float32),
                 jnp.zeros((bm,), jnp.float32))
        common = dict(s=s, kvh=kvh, q=q, pos=pos, kv_start=kv_start, kv_end=kv_end,
                      bt_ref=bt_ref, k_ref=k_ref, v_ref=v_ref, st=st)
        # [a, b): every row sees them in full; [lo, a): window-edge chunks and [b, hi):
        # diagonal chunks, masked.
        a = jnp.clip(w_lo, lo, hi)
        b = jnp.clip(n_unmasked, a, hi)
        carry = _attend_chunks(a, b, carry, masked=False, **common)
        if st.sliding_window is None:  # a == lo
            acc, m, l = _attend_chunks(b, hi, carry, masked=True, **common)
        else:
            acc, m, l = _attend_chunks(lo, hi, carry, masked=True, skip=(a, b), **common)
        l_safe = jnp.where(l > 0, l, 1.0)  # l == 0 only for a split with no chunk: acc == 0
        lse = m + jnp.log2(l_safe)
        store(t, valid, acc / l_safe[:, None], lse)

    def real_tile():
        s = _find_seq(qsl_ref, p_id, num_seqs, st)
        j0 = (p_id - (qsl_ref[s] // st.q_tile + s)) * st.q_tile
        q_start = qsl_ref[s]
        q_len = qsl_ref[s + 1] - q_start
        lax.cond(j0 < q_len, lambda: attend(s, j0, q_start, q_len), lambda: None)

    lax.cond(p_id >= first_pad, write_padding, real_tile)


# ----------------------------------------------------------------------- pallas_call wrapper


def _call(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
          st: _Static, num_warps: int, num_stages: int, interpret: bool):
    T, Hq, D = q.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    S = block_tables.shape[0]
    grid = (pl.cdiv(T, st.q_tile) + S, Hkv) + ((st.num_splits,) if st.num_splits > 1 else ())
    if st.num_splits > 1:
        out_shape = (jax.ShapeDtypeStruct((st.num_splits, T * Hq, D), jnp.float32),
                     jax.ShapeDtypeStruct((st.num_splits, T * Hq), jnp.float32))
    else:
        out_shape = jax.ShapeDtypeStruct((T * Hq, D), q.dtype)
    kind = "split" if st.num_splits > 1 else "plain"
    out = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{kind}_m{st.block_m}_n{st.block_n}",
    )(
        jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        query_start_loc,
        seq_lens,
        block_tables,
        q.reshape(T * Hq, D),  # free reshapes: row-major views
        k_cache.reshape(num_blocks * block_size, Hkv, D),
        v_cache.reshape(num_blocks * block_size, Hkv, D),
    )
    if st.num_splits == 1:
        return out.reshape(T, Hq, D)
    o_part, lse = out  # [splits, T * Hq, D], [splits, T * Hq]
    lse_max = jnp.max(lse, axis=0)  # [T * Hq]
    w = jnp.exp2(lse - lse_max[None])  # [splits, T * Hq]; all-_MASK rows get equal weights
    o = jnp.sum(w[..., None] * o_part, axis=0) / jnp.sum(w, axis=0)[:, None]
    return o.reshape(T, Hq, D).astype(q.dtype)


# --------------------------------------------------------------------------- public function


def _f32_precision(interpret: bool):
    # On the GPU, plain f32 dots would either round to TF32 (10-bit mantissa) or run on FMA
    # units, where the [BM, D] x [D, BN] tiles spill registers; 3xTF32 keeps tensor cores and
    # ~f32 accuracy. The CPU interpreter has no TF32 and computes f32 exactly.
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def plan(q_shape, k_cache_shape, block_tables_shape, dtype, **tuning):
    """The static choices for these shapes: (_Static minus scale, num_warps, num_stages).

    Exposed so that tests and benchmarks can see which variant a shape gets.
    """
    unknown = set(tuning) - _TUNING_KEYS
    if unknown:
        raise ValueError(f"unknown tuning keys {sorted(unknown)}; allowed: {sorted(_TUNING_KEYS)}")
    T, Hq, D = q_shape
    _, block_size, Hkv, _ = k_cache_shape
    S, max_blocks = block_tables_shape
    G = Hq // Hkv
    target = tuning.get("target") or tuning_lib.detect_target()
    decode_heavy = T <= tuning_lib.TARGETS.get(target, tuning_lib.TARGETS["default"]
                                                ).decode_tokens_per_seq * S
    cfg = tuning_lib.tile_config(target, decode_heavy=decode_heavy,
                                 itemsize=jnp.dtype(dtype).itemsize)
    block_m = tuning.get("block_m") or max(cfg.block_m, 1 << (G - 1).bit_length())
    block_n = tuning.get("block_n") or cfg.block_n
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if not (_pow2(val) and val >= 16):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    if block_m < G:
        raise ValueError(f"block_m={block_m} must be >= the GQA group size {G}")
    q_tile = block_m // G
    splits = tuning.get("num_kv_splits")
    if splits is None:
        busy = max(S, pl.cdiv(T, q_tile)) * Hkv
        splits = tuning_lib.num_kv_splits(target, busy_programs=busy,
                                          max_context=max_blocks * block_size)
    if not (isinstance(splits, int) and splits >= 1):
        raise ValueError(f"num_kv_splits must be an int >= 1, got {splits!r}")
    st = _Static(block_m=block_m, block_n=block_n, group=G, q_tile=q_tile, num_q_heads=Hq,
                 num_tokens=T, block_size=block_size,
                 search_steps=max(1, math.ceil(math.log2(S + 1))), num_splits=splits,
                 scale_log2=0.0, sm_scale=0.0, sliding_window=None, logits_soft_cap=None,
                 precision=None)  # set by ragged_paged_attention
    return st, tuning.get("num_warps") or cfg.num_warps, tuning.get("num_stages") or cfg.num_stages


def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           num_seqs, *, sm_scale, sliding_window=None, logits_soft_cap=None,
                           interpret=False, **tuning):
    """Causal attention of packed new tokens over a paged KV cache (see the module docstring).

    q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (already holding the new
    tokens' K/V); block_tables int32 [S, max_blocks]; seq_lens int32 [S] (cached + new);
    query_start_loc int32 [S + 1] (qsl[0] == 0, non-decreasing); num_seqs int32 scalar.
    Returns [T, Hq, D]; rows from query_start_loc[num_seqs] on are zeros.
    sm_scale: a Python float (it is baked into the kernel); sliding_window (int >= 1) and
    logits_soft_cap (float > 0), both static, as in kernels/reference.py.
    tuning: target ("h100" | "a100" | "default"; detected from the default device when not
    given), block_m, block_n, num_warps, num_stages, num_kv_splits (1 = plain kernel).
    """
    if q.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(f"q must be [T, Hq, D] and k_cache [num_blocks, block_size, Hkv, D], "
                         f"got {q.shape} and {k_cache.shape}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must match, got {k_cache.shape} {k_cache.dtype} "
                         f"and {v_cache.shape} {v_cache.dtype}")
    T, Hq, D = q.shape
    _, _, Hkv, Dk = k_cache.shape
    S = block_tables.shape[0]
    if Dk != D or Hq % Hkv:
        raise ValueError(f"q heads/dim {Hq}/{D} incompatible with cache kv heads/dim {Hkv}/{Dk}")
    if q.dtype != k_cache.dtype or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q and cache dtype must be one of float32, bfloat16, float16 and "
                         f"equal, got {q.dtype} and {k_cache.dtype}")
    if not _pow2(D) or D < 16:
        raise ValueError(f"head dim must be a power of two >= 16, got {D}")
    if block_tables.ndim != 2 or seq_lens.shape != (S,) or query_start_loc.shape != (S + 1,):
        raise ValueError(f"expected block_tables [S, B], seq_lens [S], query_start_loc [S + 1]; "
                         f"got {block_tables.shape}, {seq_lens.shape}, {query_start_loc.shape}")
    for name, a in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("num_seqs", num_seqs)):
        if jnp.result_type(a) != jnp.int32:
            raise ValueError(f"{name} must be int32, got {jnp.result_type(a)}")
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}")
    st, num_warps, num_stages = plan(q.shape, k_cache.shape, block_tables.shape, q.dtype,
                                     **tuning)
    st = dataclasses.replace(st, scale_log2=float(sm_scale) * _LOG2E, sm_scale=float(sm_scale),
                             sliding_window=sliding_window,
                             logits_soft_cap=None if logits_soft_cap is None
                             else float(logits_soft_cap),
                             precision=_f32_precision(interpret) if q.dtype == jnp.float32
                             else None)
    return _call(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                 st=st, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
