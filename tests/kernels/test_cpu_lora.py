"""The C++ batched multi-LoRA (kernels/cpu_lora.py, csrc/cpu_lora.cc) against a float64
numpy oracle: each token's own slot's x @ A (rounded to the tables' dtype, as the kernel's
contract says) @ B added to y, tokens without an adapter untouched bit for bit. Groups of
uneven sizes (1 token, none, more than one 8-token block, a tail), tokens with no adapter
(the fill slot, -1, past the tables), an adapter of rank below R (zero-padded), K, N and R
not multiples of the 16-lane vectors, bf16 and f32 tables and outputs, and a call large
enough for the thread pool.
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxllm.kernels import cpu_lora
from platform_choice import ON_GPU

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="setup.py builds the cpu LoRA library on Linux only"),
    pytest.mark.skipif(ON_GPU, reason="the C++ LoRA runs on the CPU platform"),
    pytest.mark.skipif(not cpu_lora.availability(jnp.float32),
                       reason=f"{cpu_lora.availability(jnp.float32).reason}"),
]


def oracle(x, y, A, B, m, layer, num_adapters, w_dtype):
    """float64 numpy: y[t] + round_w(x[t] @ A[m_t, layer]) @ B[m_t, layer] where m_t has an
    adapter, in float64 (the caller compares after the kernel's one rounding)."""
    out = np.asarray(y, np.float64).copy()
    for t, s in enumerate(np.asarray(m)):
        if 0 <= s < num_adapters:
            xa = np.asarray(x[t], np.float64) @ np.asarray(A[s, layer], np.float64)
            xa = xa.astype(w_dtype).astype(np.float64)
            out[t] += xa @ np.asarray(B[s, layer], np.float64)
    return out


def case(rng, T, K, N, R, S, L, w_dtype, y_dtype, m):
    x = rng.normal(0, 1, (T, K)).astype(w_dtype)
    y = rng.normal(0, 1, (T, N)).astype(y_dtype)
    A = rng.normal(0, K ** -0.5, (S, L, K, R)).astype(w_dtype)
    B = rng.normal(0, 0.5, (S, L, R, N)).astype(w_dtype)
    A[S - 1], B[S - 1] = 0, 0              # the fill slot: zeros, as the feature keeps it
    A[0, :, :, 3:], B[0, :, 3:] = 0, 0     # slot 0: an adapter of rank 3 < R, zero-padded
    return x, y, A, B, np.asarray(m, np.int32)


def check(x, y, A, B, m, layer, num_adapters):
    w_dtype = x.dtype
    got = np.asarray(jax.jit(cpu_lora.lora_apply, static_argnums=(5, 6))(
        x, y, A, B, m, layer, num_adapters)).astype(np.float64)
    want = oracle(x, y, A, B, m, layer, num_adapters, w_dtype)
    has = (m >= 0) & (m < num_adapters)
    # Untouched rows: bit for bit.
    np.testing.assert_array_equal(got[~has], np.asarray(y, np.float64)[~has])
    # Adapter rows: within the kernel's f32 sums and its one rounding to y's dtype (a bf16
    # xa may round the other way at a tie of the f32 and f64 sums: one bf16 ulp of xa).
    if not has.any():
        return got
    delta = np.abs(want - np.asarray(y, np.float64))[has]
    ulp = 2.0 ** -8 if y.dtype == ml_dtypes.bfloat16 else 2.0 ** -23
    xa_ulp = 2.0 ** -8 if w_dtype == ml_dtypes.bfloat16 else 2.0 ** -22
    tol = ulp * np.abs(want[has]) + 2 * xa_ulp * delta.max() + 1e-6
    assert np.all(np.abs(got[has] - want[has]) <= tol), np.max(np.abs(got[has] - want[has]))
    return got


M_UNEVEN = ([0] + [2] * 12 + [3] * 9 + [4] * 5 + [-1, 7] + [2, 3, 0])  # slot 1 empty


@pytest.mark.parametrize("w_dtype,y_dtype", [(np.float32, np.float32),
                                             (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                                             (ml_dtypes.bfloat16, np.float32)])
@pytest.mark.parametrize("K,R", [(40, 16), (40, 24), (39, 5)])
def test_uneven_groups_against_the_float64_oracle(w_dtype, y_dtype, K, R):
    rng = np.random.default_rng(R)
    m = np.array(M_UNEVEN, np.int32)
    rng.shuffle(m)  # tokens of one slot scattered over the batch, as in a decode step
    x, y, A, B, m = case(rng, len(m), K, 70, R, 5, 3, w_dtype, y_dtype, m)
    check(x, y, A, B, m, 1, 4)


def test_large_call_runs_on_the_pool_and_agrees():
    rng = np.random.default_rng(0)
    T = 300
    m = rng.integers(-1, 5, T).astype(np.int32)
    x, y, A, B, m = case(rng, T, 576, 1536, 16, 5, 2, ml_dtypes.bfloat16, ml_dtypes.bfloat16, m)
    assert T * (576 + 1536) * 16 > 1 << 21  # past the kernel's inline threshold
    check(x, y, A, B, m, 0, 4)


def test_no_adapter_at_all_returns_y_and_y_stays_intact_when_not_aliased():
    rng = np.random.default_rng(1)
    m = np.full(9, 4, np.int32)
    x, y, A, B, m = case(rng, 9, 32, 48, 16, 5, 1, np.float32, np.float32, m)
    np.testing.assert_array_equal(check(x, y, A, B, m, 0, 4), y)
    m[3] = 2  # y is also returned: XLA cannot alias it with the result, the kernel copies
    y_in, out = jax.jit(lambda y_: (y_, cpu_lora.lora_apply(x, y_, A, B, m, 0, 4)))(y)
    np.testing.assert_array_equal(np.asarray(y_in), y)
    assert not np.array_equal(np.asarray(out)[3], y[3])
    np.testing.assert_array_equal(np.delete(np.asarray(out), 3, 0), np.delete(y, 3, 0))


def test_matches_the_xla_reference():
    rng = np.random.default_rng(2)
    m = rng.integers(0, 5, 33).astype(np.int32)
    x, y, A, B, m = case(rng, 33, 64, 80, 16, 5, 2, np.float32, np.float32, m)
    got = cpu_lora.lora_apply(x, y, A, B, m, 1, 4)
    want = cpu_lora.lora_apply_reference(x, y, A, B, m, 1, 4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(layer=3), r"layer must be in \[0, 3\)"),
    (dict(num_adapters=6), r"num_adapters must be in \[0, 5\]"),
    (dict(m=np.zeros(4, np.int64)), "m must be int32"),
    (dict(A=np.zeros((5, 3, 8, 4), np.float32)), "disagree"),
    (dict(x=np.zeros((4, 8), ml_dtypes.bfloat16)), "all float32 or all bfloat16"),
])
def test_bad_input_is_a_value_error(change, match):
    args = dict(x=np.zeros((4, 8), np.float32), y=np.zeros((4, 6), np.float32),
                A=np.zeros((5, 3, 8, 4), np.float32), B=np.zeros((5, 3, 4, 6), np.float32),
                m=np.zeros(4, np.int32), layer=0, num_adapters=4)
    if "A" in change:
        args["B"] = np.zeros((5, 3, 5, 6), np.float32)
        change = {}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        cpu_lora.lora_apply(args["x"], args["y"], args["A"], args["B"], args["m"],
                            args["layer"], args["num_adapters"])


@pytest.fixture
def fresh_choice():
    for fn in (cpu_lora.availability, cpu_lora._library, cpu_lora.warn_unavailable):
        fn.cache_clear()
    yield
    for fn in (cpu_lora.availability, cpu_lora._library, cpu_lora.warn_unavailable):
        fn.cache_clear()


def test_lora_picks_the_kernel_on_one_cpu_device_and_xla_under_tp(fresh_choice, recwarn):
    from jaxllm.lora.apply import choose_apply, cpu_apply, xla_apply
    assert choose_apply(jnp.bfloat16, single_device=True) is cpu_apply
    assert choose_apply(jnp.bfloat16, single_device=False) is xla_apply
    assert not [w for w in recwarn if "LoRA" in str(w.message)]


def test_a_missing_library_is_said_once_and_lora_runs_in_xla(fresh_choice, monkeypatch):
    from jaxllm.lora.apply import choose_apply, xla_apply
    monkeypatch.setattr(cpu_lora.native_library, "find", lambda stem: None)
    with pytest.warns(RuntimeWarning,
                      match=r"CPU LoRA kernel is unavailable \(the library _cpu_lora\*.so is "
                            r"not built.*LoRA runs in XLA"):
        assert choose_apply(jnp.float32, single_device=True) is xla_apply
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_apply(jnp.float32, single_device=True) is xla_apply  # said once


@pytest.mark.parametrize("m", [[4, 4, 4, 4, 4], [2, 4, 2, 2, 4], [0, 3, 4, 1, 3]],
                         ids=["no adapter", "one adapter", "several"])
def test_the_xla_switch_agrees_with_the_kernel(m):
    """lora/apply.py's two ways (XLA's three branches; the kernel) on one problem, f32."""
    from jaxllm.lora.apply import cpu_apply, xla_apply
    rng = np.random.default_rng(3)
    x, y, A, B, m = case(rng, 5, 24, 40, 8, 5, 2, np.float32, np.float32, m)
    got = jax.jit(xla_apply, static_argnums=(5, 6))(x, y, A, B, m, 1, 4)
    want = jax.jit(cpu_apply, static_argnums=(5, 6))(x, y, A, B, m, 1, 4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bf16_rounding_is_nearest_even_bit_for_bit():
    """Products and sums exact in f32 (dyadic values of few bits), so only the one rounding
    of y + delta to bf16 is left: it must be numpy's (ml_dtypes') round to nearest even,
    ties included, NaN kept NaN, for every lane of a 37-wide row (the masked tail too)."""
    T, N = 3, 37
    x = np.ones((T, 1), np.float32)
    A = np.ones((2, 1, 1, 1), np.float32)
    B = np.zeros((2, 1, 1, N), np.float32)
    B[0, 0, 0] = (np.arange(N) - 18) * 2.0 ** -9  # below bf16's 8 bits at |y| ~ 1: ties too
    y = (1 + np.arange(T * N).reshape(T, N) % 5 * 2.0 ** -7).astype(ml_dtypes.bfloat16)
    y[2, 4] = np.nan
    m = np.array([0, 1, 0], np.int32)  # row 1: the fill slot, no adapter
    got = np.asarray(cpu_lora.lora_apply(x, y, A, B, m, 0, 1))
    want = y.copy()
    exact = y.astype(np.float32)[[0, 2]] + B[0, 0, 0]
    want[[0, 2]] = exact.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
