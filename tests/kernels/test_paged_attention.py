"""Tier 1: the Pallas kernel under the Pallas interpreter (CPU) and the XLA reference, both
against a float64 numpy reference, on hypothesis-drawn ragged batches. With
JAXLLM_TEST_PLATFORM=gpu (tests/conftest.py) the kernel is compiled by Triton and runs on the
GPU instead, against the same oracle.

The batches, their NaN traps, the float64 oracle and the tolerances live in tests/kernels/
oracle.py, shared with the "xla" backend's tests (test_xla_attention.py).
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
from oracle import Batch, Shape, batches, check, make_inputs
from platform_choice import ON_GPU

# When a hypothesis example fails, hypothesis' pytest plugin imports libcst (to print a patch)
# and libcst 1.0.1 uses the deprecated mypy_extensions.TypedDict; with warnings as errors that
# turns the real failure report into a pytest INTERNALERROR.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")

@functools.cache
def kernel_fn(shape: Shape):
    return jax.jit(functools.partial(pa.ragged_paged_attention, sm_scale=shape.D ** -0.5,
                                     interpret=not ON_GPU, target="default",
                                     **dict(shape.tuning), **shape.options))


@functools.cache
def reference_fn(shape: Shape):
    from jaxllm.kernels import reference
    return jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=shape.D ** -0.5))


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


# Sliding windows (NaN before each window) that start mid-chunk, with and without the soft
# cap, on the plain and the split grid; 16-key chunks so windows of 23 / 40 keys span several
# (edge chunks, fully visible chunks, diagonal chunks).
WINDOWED = [
    Shape(T=16, S=4, max_blocks=8, Hkv=2, G=2, D=64, dtype="float32", sliding_window=23,
          logits_soft_cap=2.0, tuning=(("num_kv_splits", 1), ("block_n", 16))),
    Shape(T=24, S=3, max_blocks=8, Hkv=1, G=4, D=64, dtype="bfloat16", sliding_window=40,
          tuning=(("num_kv_splits", 3), ("block_n", 16))),
]


@pytest.mark.parametrize("shape", WINDOWED, ids=["w23-cap-plain", "w40-split3"])
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_window_and_soft_cap_match_float64(shape, data):
    kind = data.draw(st.sampled_from(KINDS))
    check(kernel_fn(shape), shape, data.draw(batches(shape, kind)))


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
    call = functools.partial(pa.ragged_paged_attention, sm_scale=0.1, interpret=not ON_GPU)
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
