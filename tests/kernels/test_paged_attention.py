"""Tier 1: the Pallas kernel under the Pallas interpreter (CPU) and the XLA reference, both
against a float64 numpy reference, on hypothesis-drawn ragged batches.

Every batch fills every cache slot that no query may see with NaN (unused pages, the tail of
the last page, padding sequences' pages, the null block 0) and the padding query rows too,
so a kernel that reads or multiplies an invisible value fails with NaN, not a small error.

Tolerances (|out - ref| <= atol + rtol * |ref|, outputs are O(1) averages of N(0, 1) values):
  float32  1e-5 / 1e-5: f32 dots, f32 softmax; error ~1e-6 from summation order.
  bfloat16 2e-2 / 2e-2: probabilities are rounded to bf16 (8-bit mantissa, 2^-9 relative)
           before the P @ V dot, and the output to bf16; observed ~1.5e-2 worst case.
  float16  4e-3 / 4e-3: the same with an 11-bit mantissa.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm.kernels import paged_attention as pa
from jaxllm.kernels import tuning

# When a hypothesis example fails, hypothesis' pytest plugin imports libcst (to print a patch)
# and libcst 1.0.1 uses the deprecated mypy_extensions.TypedDict; with warnings as errors that
# turns the real failure report into a pytest INTERNALERROR.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")

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
    dtype = jnp.dtype(shape.dtype)

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
        pos = np.arange(seq_lens[s])
        blk, off = block_tables[s, pos // bs], pos % bs
        k[blk, off] = rng.standard_normal((len(pos), Hkv, D))
        v[blk, off] = rng.standard_normal((len(pos), Hkv, D))
    # A few peaky rows: scaled queries make softmax nearly one-hot.
    q = rng.standard_normal((shape.T, Hq, D)) * rng.choice([0.5, 1.0, 4.0], (shape.T, 1, 1))
    q[qsl[num_seqs]:] = np.nan
    cast = lambda a: np.asarray(jnp.asarray(a, dtype))  # round once; the reference sees it too
    return dict(q=cast(q), k_cache=cast(k), v_cache=cast(v), block_tables=block_tables,
                seq_lens=seq_lens, query_start_loc=qsl, num_seqs=np.int32(num_seqs))


def reference_f64(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                  sm_scale):
    """Token by token, in float64, straight from the definition."""
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
            scores = np.einsum("kgd,lkd->kgl", q_kgd, k[:p + 1]) * sm_scale
            w = np.exp(scores - scores.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[t] = np.einsum("kgl,lkd->kgd", w, v[:p + 1]).reshape(Hq, D)
    return out


@functools.cache
def kernel_fn(shape: Shape):
    return jax.jit(functools.partial(pa.ragged_paged_attention, sm_scale=shape.D ** -0.5,
                                     interpret=True, target="default", **dict(shape.tuning)))


@functools.cache
def reference_fn(shape: Shape):
    from jaxllm.kernels import reference
    return jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=shape.D ** -0.5))


def check(fn, shape: Shape, batch: Batch):
    inputs = make_inputs(shape, batch)
    out = np.asarray(fn(**{k: jnp.asarray(v) for k, v in inputs.items()})).astype(np.float64)
    ref = reference_f64(**inputs, sm_scale=shape.D ** -0.5)
    end = int(inputs["query_start_loc"][len(batch.q_lens)])
    assert np.all(out[end:] == 0), "padding rows must be exactly zero"
    assert not np.isnan(out).any(), "NaN from an invisible cache slot or padding row"
    tol = TOLERANCE[shape.dtype]
    err = np.abs(out - ref)
    assert np.all(err <= tol + tol * np.abs(ref)), f"max error {err.max():.3g} (tol {tol})"
    return float(err.max())


# ------------------------------------------------------------------ hypothesis batches


@st.composite
def batches(draw, shape: Shape, kind: str):
    """A ragged batch of `kind` decode / prefill / mixed fitting the static `shape`."""
    bs, L = shape.block_size, shape.max_blocks * shape.block_size
    # Context lengths cluster around page (and key-chunk) boundaries.
    near_boundary = st.sampled_from(sorted({max(0, min(L, bs * i + d))
                                            for i in range(shape.max_blocks + 1)
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
            ctx = min(draw(st.one_of(near_boundary, st.integers(0, L))), L - q_len)
        q_lens.append(q_len)
        ctx_lens.append(ctx)
    return Batch(tuple(q_lens), tuple(ctx_lens), draw(st.integers(0, 2 ** 31 - 1)))


# Static shapes: each is one compile (a few seconds in the interpreter), so they are few and
# chosen to cover G in 1..8 (including G that does not divide the 16-row tile), D 64 / 128,
# f32 / bf16 / f16, the plain and split-KV grids, and several key chunks per sequence.
SHAPES = [
    Shape(T=8, S=8, max_blocks=32, Hkv=2, G=4, D=64, dtype="float32"),  # auto-chosen split
    Shape(T=32, S=4, max_blocks=5, Hkv=2, G=1, D=64, dtype="float32",
          tuning=(("num_kv_splits", 1), ("block_n", 16))),
    Shape(T=32, S=4, max_blocks=5, Hkv=1, G=3, D=128, dtype="float32",
          tuning=(("num_kv_splits", 3),)),
    Shape(T=40, S=5, max_blocks=4, Hkv=2, G=8, D=64, dtype="bfloat16",
          tuning=(("num_kv_splits", 1),)),
    Shape(T=24, S=4, max_blocks=5, Hkv=2, G=5, D=128, dtype="bfloat16",
          tuning=(("num_kv_splits", 2), ("block_n", 32))),
    Shape(T=48, S=3, max_blocks=4, Hkv=1, G=2, D=64, dtype="bfloat16",
          tuning=(("block_m", 32), ("block_n", 16), ("num_kv_splits", 1))),
    Shape(T=16, S=4, max_blocks=6, Hkv=2, G=6, D=128, dtype="float16",
          tuning=(("num_kv_splits", 2),)),
    Shape(T=20, S=4, max_blocks=5, Hkv=1, G=7, D=64, dtype="bfloat16",
          tuning=(("num_kv_splits", 1),)),
]
KINDS = ["decode", "prefill", "mixed"]


def _plan(shape: Shape):
    Hq = shape.Hkv * shape.G
    return pa.plan((shape.T, Hq, shape.D), (shape.num_blocks, shape.block_size, shape.Hkv,
                                            shape.D), (shape.S, shape.max_blocks),
                   jnp.dtype(shape.dtype), target="default", **dict(shape.tuning))[0]


def test_shapes_cover_both_grids():
    assert {_plan(s).num_splits > 1 for s in SHAPES} == {True, False}
    assert _plan(SHAPES[0]).num_splits == 2  # picked by the "default" tuning, not forced


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s.T}-G{s.G}-D{s.D}-{s.dtype}"
                         f"-splits{_plan(s).num_splits}")
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_kernel_matches_float64(shape, data):
    kind = data.draw(st.sampled_from(KINDS))
    check(kernel_fn(shape), shape, data.draw(batches(shape, kind)))


@pytest.mark.parametrize("shape", SHAPES[::2], ids=lambda s: f"T{s.T}-G{s.G}-D{s.D}-{s.dtype}")
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_xla_reference_matches_float64(shape, data):
    kind = data.draw(st.sampled_from(KINDS))
    check(reference_fn(shape), shape, data.draw(batches(shape, kind)))


# --------------------------------------------------------------- named, fixed batches

MIXED_SHAPE = Shape(T=16, S=4, max_blocks=4, Hkv=2, G=4, D=64, dtype="bfloat16",
                    tuning=(("num_kv_splits", 1),))


@pytest.mark.parametrize("batch", [
    Batch(q_lens=(1, 1, 1), ctx_lens=(0, 15, 47), seed=1),  # decode only, page edges
    Batch(q_lens=(7, 9), ctx_lens=(0, 0), seed=2),  # prefill only
    # The module docstring's example: 6 + 1 + 5 tokens, padding rows 12..15; plus chunks
    # over a cached prefix and a sequence with no new token.
    Batch(q_lens=(6, 1, 5), ctx_lens=(10, 33, 16), seed=3),
    Batch(q_lens=(6, 0, 1, 5), ctx_lens=(10, 20, 33, 16), seed=4),
    Batch(q_lens=(), ctx_lens=(), seed=5),  # no sequence: all padding
], ids=["decode", "prefill", "mixed", "mixed-empty-seq", "empty"])
@pytest.mark.parametrize("splits", [1, 3])
def test_fixed_batches(batch, splits):
    shape = dataclasses.replace(MIXED_SHAPE, tuning=(("num_kv_splits", splits),))
    check(kernel_fn(shape), shape, batch)


def test_split_and_plain_agree():
    # Same inputs through both grids; in f32 they differ only by summation order.
    base = Shape(T=8, S=2, max_blocks=8, Hkv=1, G=4, D=64, dtype="float32")
    batch = Batch(q_lens=(1, 3), ctx_lens=(100, 61), seed=6)
    inputs = {k: jnp.asarray(v) for k, v in make_inputs(base, batch).items()}
    outs = [np.asarray(kernel_fn(dataclasses.replace(base, tuning=(("num_kv_splits", n),)))(
        **inputs)) for n in (1, 4)]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- variant choice, errors


def test_plan_picks_split_for_few_long_sequences():
    # 4 decode tokens x 8 KV heads leave most of 132 SMs idle: split the keys.
    few, _, _ = pa.plan((4, 32, 128), (4096, 16, 8, 128), (4, 2048), jnp.bfloat16,
                        target="h100")
    assert few.num_splits > 1 and few.block_m == 16 and few.q_tile == 4
    # 64 sequences x 8 heads = 512 programs already fill the GPU.
    many, _, _ = pa.plan((64, 32, 128), (4096, 16, 8, 128), (64, 128), jnp.bfloat16,
                         target="h100")
    assert many.num_splits == 1 and many.block_m == 16
    # Prefill-heavy: tall tiles.
    pre, warps, _ = pa.plan((2048, 32, 128), (4096, 16, 8, 128), (8, 128), jnp.bfloat16,
                            target="a100")
    assert (pre.num_splits, pre.block_m, pre.q_tile) == (1, 64, 16)
    assert warps == tuning.TARGETS["a100"].prefill.num_warps
    # Explicit knobs win.
    forced, warps, stages = pa.plan((4, 32, 128), (4096, 16, 8, 128), (4, 2048), jnp.bfloat16,
                                    target="h100", num_kv_splits=1, block_n=128,
                                    num_warps=8, num_stages=4)
    assert (forced.num_splits, forced.block_n, warps, stages) == (1, 128, 8, 4)


def test_group_larger_than_default_tile_grows_the_tile():
    st_, _, _ = pa.plan((8, 32, 64), (64, 16, 1, 64), (8, 4), jnp.bfloat16, target="h100")
    assert (st_.block_m, st_.q_tile) == (32, 1)


def test_rejects_bad_arguments():
    q = jnp.zeros((8, 4, 64), jnp.bfloat16)
    k = jnp.zeros((10, 16, 2, 64), jnp.bfloat16)
    meta = (jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32),
            jnp.zeros((3,), jnp.int32), jnp.int32(0))
    call = functools.partial(pa.ragged_paged_attention, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="unknown tuning keys"):
        call(q, k, k, *meta, blockm=16)
    with pytest.raises(ValueError, match="power of two"):
        call(q, k, k, *meta, block_n=24)
    with pytest.raises(ValueError, match="dtype"):
        call(q.astype(jnp.float32), k, k, *meta)
    with pytest.raises(ValueError, match="int32"):
        call(q, k, k, meta[0].astype(jnp.int16), *meta[1:])
    with pytest.raises(ValueError, match="target"):
        call(q, k, k, *meta, target="tpu")
