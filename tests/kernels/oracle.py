"""Shared test oracle for the attention backends: ragged batches with NaN traps, a float64
reference straight from the definition, and the comparison every backend test uses.

Every batch fills every cache slot that no query may see with NaN (unused pages, the tail of
the last page, padding sequences' pages, the null block 0, and with a sliding window every
slot before the window of the sequence's first new token) and the padding query rows too,
so a kernel that reads or multiplies an invisible value fails with NaN, not a small error.

Tolerances (|out - ref| <= atol + rtol * |ref|, outputs are O(1) averages of N(0, 1) values):
  float32  1e-5 / 1e-5: f32 dots, f32 softmax; error ~1e-6 from summation order.
  bfloat16 2e-2 / 2e-2: probabilities are rounded to bf16 (8-bit mantissa, 2^-9 relative)
           before the P @ V dot, and the output to bf16; observed ~1.5e-2 worst case.
  float16  4e-3 / 4e-3: the same with an 11-bit mantissa.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The static shapes of one compiled kernel (one jit cache entry per Shape)."""
    T: int
    S: int
    max_blocks: int
    Hkv: int
    G: int
    D: int
    dtype: str
    block_size: int = 16
    tuning: tuple = ()  # extra tuning kwargs as (key, value) pairs
    # The attention options (kernels/reference.py), static like the shapes.
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    @property
    def options(self) -> dict:
        """The options that are set, as the kernels' keywords."""
        return {k: v for k, v in (("sliding_window", self.sliding_window),
                                  ("logits_soft_cap", self.logits_soft_cap)) if v is not None}

    @property
    def num_blocks(self):  # every page of every sequence, the null block, 3 spare NaN blocks
        return 1 + self.S * self.max_blocks + 3


@dataclasses.dataclass(frozen=True)
class Batch:
    q_lens: tuple[int, ...]  # per real sequence
    ctx_lens: tuple[int, ...]  # cached tokens per real sequence
    seed: int


def make_inputs(shape: Shape, batch: Batch):
    """numpy arrays for one call; invisible cache slots and padding q rows are NaN."""
    rng = np.random.default_rng(batch.seed)
    bs, S, B, Hkv, D = shape.block_size, shape.S, shape.max_blocks, shape.Hkv, shape.D
    Hq = Hkv * shape.G
    num_seqs = len(batch.q_lens)

    qsl = np.zeros(S + 1, np.int32)
    qsl[1:num_seqs + 1] = np.cumsum(batch.q_lens)
    # Padding sequences: plausible garbage the kernel must not read.
    qsl[num_seqs + 1:] = np.sort(rng.integers(qsl[num_seqs], shape.T + 1, S - num_seqs))
    seq_lens = rng.integers(0, B * bs + 1, S).astype(np.int32)
    seq_lens[:num_seqs] = np.add(batch.q_lens, batch.ctx_lens)

    pages = rng.permutation(np.arange(1, shape.num_blocks))
    block_tables = rng.choice([0, *pages[-3:]], size=(S, B)).astype(np.int32)  # NaN pages
    k = np.full((shape.num_blocks, bs, Hkv, D), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for s in range(num_seqs):
        n = -(-int(seq_lens[s]) // bs)
        block_tables[s, :n] = pages[s * B: s * B + n]
        # Slots before the first new token's window stay NaN: no query of s may read them.
        first = 0 if shape.sliding_window is None else \
            max(0, int(seq_lens[s]) - batch.q_lens[s] - shape.sliding_window + 1)
        pos = np.arange(first, seq_lens[s])
        blk, off = block_tables[s, pos // bs], pos % bs
        k[blk, off] = rng.standard_normal((len(pos), Hkv, D))
        v[blk, off] = rng.standard_normal((len(pos), Hkv, D))
    # A few peaky rows: scaled queries make softmax nearly one-hot.
    q = rng.standard_normal((shape.T, Hq, D)) * rng.choice([0.5, 1.0, 4.0], (shape.T, 1, 1))
    q[qsl[num_seqs]:] = np.nan
    # Round once: the oracle sees the same values.
    cast = lambda a: np.asarray(jnp.asarray(a, shape.dtype))  # noqa: E731
    return dict(q=cast(q), k_cache=cast(k), v_cache=cast(v), block_tables=block_tables,
                seq_lens=seq_lens, query_start_loc=qsl, num_seqs=np.int32(num_seqs))


def reference_f64(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                  sm_scale, sliding_window=None, logits_soft_cap=None):
    """Token by token, in float64, straight from the definition: a query at position p sees
    the keys j with max(0, p - sliding_window + 1) <= j <= p; scores are capped to
    c * tanh(s / c) with c = logits_soft_cap."""
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    k_flat = k_cache.astype(np.float64).reshape(-1, Hkv, D)
    v_flat = v_cache.astype(np.float64).reshape(-1, Hkv, D)
    out = np.zeros((T, Hq, D))
    for s in range(int(num_seqs)):
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        ctx = seq_lens[s] - q_len
        pos = np.arange(seq_lens[s])
        slots = block_tables[s, pos // bs] * bs + pos % bs
        k, v = k_flat[slots], v_flat[slots]  # [L, Hkv, D]
        for j in range(q_len):
            t, p = query_start_loc[s] + j, ctx + j
            q_kgd = q[t].astype(np.float64).reshape(Hkv, G, D)
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            scores = np.einsum("kgd,lkd->kgl", q_kgd, k[lo:p + 1]) * sm_scale
            if logits_soft_cap is not None:
                scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[t] = np.einsum("kgl,lkd->kgd", w, v[lo:p + 1]).reshape(Hq, D)
    return out


def run(fn, inputs):
    return np.asarray(fn(**{k: jnp.asarray(v) for k, v in inputs.items()})).astype(np.float64)


def check(fn, shape: Shape, batch: Batch):
    """fn(**inputs) against the float64 reference; padding rows exactly 0, no NaN."""
    inputs = make_inputs(shape, batch)
    out = run(fn, inputs)
    ref = reference_f64(**inputs, sm_scale=shape.D ** -0.5, **shape.options)
    end = int(inputs["query_start_loc"][len(batch.q_lens)])
    assert np.all(out[end:] == 0), "padding rows must be exactly zero"
    assert not np.isnan(out).any(), "NaN from an invisible cache slot or padding row"
    tol = TOLERANCE[shape.dtype]
    err = np.abs(out - ref)
    assert np.all(err <= tol + tol * np.abs(ref)), f"max error {err.max():.3g} (tol {tol})"
    return float(err.max())


@st.composite
def batches(draw, shape: Shape, kind: str, max_ctx: int | None = None):
    """A ragged batch of `kind` decode / prefill / mixed fitting the static `shape`;
    `max_ctx` caps the cached context (to leave most of a wide block table unused)."""
    bs, L = shape.block_size, shape.max_blocks * shape.block_size
    cap = L if max_ctx is None else min(L, max_ctx)
    # Context lengths cluster around page (and key-chunk) boundaries.
    near_boundary = st.sampled_from(sorted({max(0, min(cap, bs * i + d))
                                            for i in range(cap // bs + 2)
                                            for d in (-1, 0, 1)}))
    num_seqs = draw(st.integers(1 if kind == "decode" else 0, shape.S))
    budget = shape.T
    q_lens, ctx_lens = [], []
    for _ in range(num_seqs):
        if kind == "decode":
            q_len = 1
        elif kind == "prefill":
            q_len = draw(st.integers(1, shape.T))
        else:
            q_len = draw(st.one_of(st.just(0), st.just(1), st.integers(2, shape.T)))
        q_len = min(q_len, budget, L)
        budget -= q_len
        if kind == "prefill":
            ctx = 0
        else:
            ctx = min(draw(st.one_of(near_boundary, st.integers(0, cap))), L - q_len)
        q_lens.append(q_len)
        ctx_lens.append(ctx)
    return Batch(tuple(q_lens), tuple(ctx_lens), draw(st.integers(0, 2 ** 31 - 1)))


def check_long_sequence_leaves_short_ones_alone(make_fn) -> None:
    """A backend's outputs for 4 short sequences are the same whether a 2000-token fifth one
    is padding (num_seqs = 4) or real and last (num_seqs = 5), and match the oracle.
    make_fn(shape) -> the backend's function for `run`."""
    shape = Shape(T=16, S=6, max_blocks=128, Hkv=3, G=3, D=64, dtype="float32")
    batch = Batch(q_lens=(1, 1, 3, 1, 1), ctx_lens=(99, 16, 40, 0, 1999), seed=7)
    inputs = make_inputs(shape, batch)
    fn = make_fn(shape)
    both = run(fn, inputs)
    short = run(fn, dict(inputs, num_seqs=np.int32(4)))
    ref = reference_f64(**inputs, sm_scale=shape.D ** -0.5)
    np.testing.assert_allclose(both[:6], short[:6], rtol=1e-6, atol=1e-6)
    assert np.all(short[6:] == 0), "rows past query_start_loc[num_seqs] are padding"
    tol = TOLERANCE["float32"]
    np.testing.assert_allclose(both[:7], ref[:7], rtol=tol, atol=tol)
    assert np.all(both[7:] == 0)
