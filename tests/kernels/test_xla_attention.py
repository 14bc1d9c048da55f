"""Backend "xla" (kernels/xla_attention.py) against the float64 oracle on hypothesis-drawn
ragged batches: decode-only, prefill-only and mixed, q_len 0 / 1 / many, contexts on page and
chunk boundaries, empty and padding sequences, GQA groups 1..8, head dims 64 / 128, f32 / bf16 /
f16, NaN in every invisible slot and padding row, block tables far wider than any sequence.

Most shapes shrink the kernel's tiles (a few keys per chunk, a few rows per tile) so that small
batches still cross every boundary of its work decomposition: several chunks per row, several
items per loop iteration, items of several rows in one iteration, several prefill tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm.kernels import backends
from jaxllm.kernels import xla_attention as xa
from oracle import (Batch, Shape, batches, check, check_long_sequence_leaves_short_ones_alone,
                    make_inputs, run)

pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")

SMALL = (("decode_chunk", 16), ("decode_items", 3), ("prefill_tile", 4), ("prefill_chunk", 32))
ODD = (("decode_chunk", 48), ("decode_items", 5), ("prefill_tile", 6), ("prefill_chunk", 16))

# (shape, cap on cached context or None). Each shape is one compile (~2 s).
SHAPES = [
    (Shape(T=16, S=8, max_blocks=64, Hkv=2, G=4, D=64, dtype="float32", tuning=SMALL), 40),
    (Shape(T=32, S=4, max_blocks=6, Hkv=1, G=3, D=128, dtype="bfloat16", tuning=SMALL), None),
    (Shape(T=24, S=5, max_blocks=5, Hkv=2, G=1, D=64, dtype="float32", tuning=ODD), None),
    (Shape(T=20, S=4, max_blocks=8, Hkv=1, G=8, D=64, dtype="float16", tuning=ODD), None),
    (Shape(T=40, S=5, max_blocks=6, Hkv=3, G=5, D=128, dtype="bfloat16"), None),
    (Shape(T=24, S=4, max_blocks=40, Hkv=1, G=7, D=64, dtype="float32"), 300),
]
KINDS = ["decode", "prefill", "mixed"]


@functools.cache
def xla_fn(shape: Shape):
    return jax.jit(functools.partial(xa.ragged_paged_attention, sm_scale=shape.D ** -0.5,
                                     **dict(shape.tuning), **shape.options))


@pytest.mark.parametrize("shape,max_ctx", SHAPES,
                         ids=lambda a: f"T{a.T}-W{a.max_blocks}-G{a.G}-D{a.D}-{a.dtype}"
                         f"{'-small' if a.tuning else ''}" if isinstance(a, Shape) else "")
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_matches_float64(shape, max_ctx, data):
    kind = data.draw(st.sampled_from(KINDS))
    check(xla_fn(shape), shape, data.draw(batches(shape, kind, max_ctx)))


FIXED = Shape(T=16, S=4, max_blocks=4, Hkv=2, G=4, D=64, dtype="bfloat16", tuning=SMALL)


@pytest.mark.parametrize("batch", [
    Batch(q_lens=(1, 1, 1), ctx_lens=(0, 15, 47), seed=1),  # decode only, page edges
    Batch(q_lens=(7, 9), ctx_lens=(0, 0), seed=2),  # prefill only
    Batch(q_lens=(6, 1, 5), ctx_lens=(10, 33, 16), seed=3),
    Batch(q_lens=(6, 0, 1, 5), ctx_lens=(10, 20, 33, 16), seed=4),  # a sequence with no row
    Batch(q_lens=(16,), ctx_lens=(48,), seed=5),  # every row, to the last slot of the table
    Batch(q_lens=(), ctx_lens=(), seed=6),  # no sequence: all padding
], ids=["decode", "prefill", "mixed", "mixed-empty-seq", "full", "empty"])
def test_fixed_batches(batch):
    check(xla_fn(FIXED), FIXED, batch)


# Sliding windows that start mid-chunk and mid-page, on contexts several windows long (the
# slots before each window hold NaN), one with the soft cap and peaky scores it flattens.
WINDOWED = [
    (Shape(T=16, S=6, max_blocks=24, Hkv=2, G=3, D=64, dtype="float32", tuning=SMALL,
           sliding_window=37, logits_soft_cap=1.5), 200),
    (Shape(T=24, S=4, max_blocks=8, Hkv=1, G=4, D=64, dtype="bfloat16", tuning=ODD,
           sliding_window=16), None),
]


@pytest.mark.parametrize("shape,max_ctx", WINDOWED, ids=["w37-cap-f32", "w16-bf16"])
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_window_and_soft_cap_match_float64(shape, max_ctx, data):
    kind = data.draw(st.sampled_from(KINDS))
    check(xla_fn(shape), shape, data.draw(batches(shape, kind, max_ctx)))


@pytest.mark.parametrize("batch", [
    Batch(q_lens=(1, 1, 1, 1), ctx_lens=(0, 36, 37, 150), seed=11),  # window edges
    Batch(q_lens=(9, 7), ctx_lens=(30, 0), seed=12),  # prefill tiles across the window
    Batch(q_lens=(5, 1, 10), ctx_lens=(64, 200, 100), seed=13),
], ids=["decode", "prefill", "mixed"])
def test_window_fixed_batches(batch):
    check(xla_fn(WINDOWED[0][0]), WINDOWED[0][0], batch)


def test_long_sequence_leaves_short_ones_alone():
    check_long_sequence_leaves_short_ones_alone(xla_fn)


def test_block_table_width_does_not_change_results():
    narrow = Shape(T=8, S=4, max_blocks=4, Hkv=2, G=2, D=64, dtype="float32", tuning=SMALL)
    batch = Batch(q_lens=(1, 5, 1), ctx_lens=(47, 10, 3), seed=8)
    inputs = make_inputs(narrow, batch)
    wide = dict(inputs, block_tables=np.pad(inputs["block_tables"], ((0, 0), (0, 124))))
    out_narrow = run(xla_fn(narrow), inputs)
    out_wide = run(xla_fn(dataclasses.replace(narrow, max_blocks=128)), wide)
    np.testing.assert_array_equal(out_narrow, out_wide)


def test_xla_backend_is_this_module():
    assert backends.get_backend("xla").attention_fn() is xa.ragged_paged_attention


@pytest.mark.parametrize("K", [1, 2])
def test_one_kv_head_write_and_attend_never_copies_the_cache(K):
    # One KV head per device (MQA, or tensor parallelism with tp = num_kv_heads): a flat
    # [blocks * block_size, 1, H] view of the cache made XLA:CPU copy the whole cache around
    # the write and the gathers.
    from jaxllm.kernels import hlo_text
    from jaxllm.kernels.backends import write_kv

    sds = jax.ShapeDtypeStruct
    T, S, W, H = 16, 4, 8, 64
    cache = sds((64, 16, K, H), np.float32)

    def step(k_cache, v_cache, k_new, slot_mapping, q, block_tables, seq_lens, qsl, num_seqs):
        k_cache = write_kv(k_cache, k_new, slot_mapping)
        v_cache = write_kv(v_cache, k_new, slot_mapping)
        out = xa.ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl,
                                        num_seqs, sm_scale=0.125)
        return out, k_cache, v_cache

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        cache, cache, sds((T, K, H), np.float32), sds((T,), np.int32),
        sds((T, 4 * K, H), np.float32), sds((S, W), np.int32), sds((S,), np.int32),
        sds((S + 1,), np.int32), sds((), np.int32)).compile()
    assert hlo_text.full_cache_copies(compiled.as_text(), compiled.memory_analysis(),
                                      [cache, cache]) == []
