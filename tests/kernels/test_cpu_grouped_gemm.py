"""The C++ grouped GEMM (kernels/cpu_grouped_gemm.py, csrc/cpu_gemm.cc) against a float64
numpy oracle, and the "cpu" linear method's expert FFN built on it.

The oracle multiplies each row by its own group's weight in float64 on the very inputs the
kernel gets; the f32 result may differ from it by the dense GEMM's bound (tests/kernels/
test_cpu_gemm.py: K roundings of the running sum, one more per product for f32 inputs), and
a bf16 result is exactly the f32 one rounded to nearest even. Groups cross the kernel's
edges: uneven sizes, an empty group (first, middle and last), one row, a group of one row,
more rows than a 72-row chunk (the weight is read again from L2 per chunk), rows past the
last group (zeros), K odd or not a multiple of the 12-row tile or the 32-column panel, N a
partial panel; sizes below and above the single-thread cut-off.
"""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import cpu_gemm, native_library
from jaxllm.kernels.cpu_grouped_gemm import grouped_gemm, grouped_gemm_reference
from platform_choice import ON_GPU

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="setup.py builds the cpu GEMM library on Linux only"),
    pytest.mark.skipif(ON_GPU, reason="the C++ GEMM runs on the CPU platform"),
    pytest.mark.skipif(not cpu_gemm.availability(jnp.bfloat16),
                       reason=f"{cpu_gemm.availability(jnp.bfloat16).reason}"),
]

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def oracle(x, w, group_end):
    """float64 y [M, N]: row r times w[its group], zero past the last group; with the
    kernel's clamping of group_end (nondecreasing, within [0, M])."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    M, N = x64.shape[0], w64.shape[2]
    y, mag = np.zeros((M, N)), np.zeros((M, N))
    begin = 0
    for e, end in enumerate(np.asarray(group_end)):
        end = min(max(int(end), begin), M)
        y[begin:end] = x64[begin:end] @ w64[e]
        mag[begin:end] = np.abs(x64[begin:end]) @ np.abs(w64[e])
        begin = end
    return y, mag


@jax.jit
def _both(x, w, group_end):
    return (grouped_gemm(x, w, group_end, jnp.float32),
            grouped_gemm(x, w, group_end, jnp.bfloat16))


def check(M, K, N, sizes, dtype, seed, group_end=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), K, N)) * 0.1, dtype)
    group_end = np.cumsum(sizes) if group_end is None else np.asarray(group_end)
    y32, y16 = _both(x, w, jnp.asarray(group_end, jnp.int32))
    exact, mag = oracle(x, w, group_end)
    roundings = K + (1 if dtype == jnp.float32 else 0)
    bound = roundings * 2.0 ** -24 * (1 + 1e-4) * mag
    err = np.abs(np.asarray(y32, np.float64) - exact)
    assert np.all(err <= bound), f"max err / bound {np.max(err / np.maximum(bound, 1e-300))}"
    np.testing.assert_array_equal(np.asarray(y16.astype(jnp.float32)),
                                  np.asarray(y32.astype(jnp.bfloat16).astype(jnp.float32)))
    return np.asarray(y32)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("M,K,N,sizes", [
    (1, 1, 1, [1]),                         # one row, one group, everything a tail
    (1, 67, 45, [0, 1, 0]),                 # one row in the middle group; empty first/last
    (37, 67, 45, [5, 0, 15, 10, 7]),        # uneven, an empty group, odd K, partial panel
    (30, 64, 32, [0, 12, 13, 0, 1, 4]),     # a full tile, one row past it, a group of one
    (40, 13, 70, [3, 20, 9]),               # rows past the last group: zeros
    (160, 96, 100, [2, 150, 8]),            # a group over three 72-row chunks
    (128, 256, 1024, [16, 40, 0, 8, 30, 2, 20, 12]),  # decode-sized experts, the pool splits
    (64, 512, 256, [9, 0, 17, 6, 8, 4, 12, 8]),       # the down projection's shape
    (20, 1025, 33, [7, 13]),                # bf16 K > 1024 (8-row tiles), odd
])
def test_matches_float64(dtype, M, K, N, sizes):
    y = check(M, K, N, sizes, DTYPES[dtype], seed=M * 1000 + K + N)
    assert not y[sum(sizes):].any()


@pytest.mark.parametrize("group_end", [[9, 4, 30], [-3, 50, 60], [0, 0, 0]])
def test_out_of_order_or_out_of_range_ends_are_clamped(group_end):
    """Descending, negative or past-M ends read and write inside the arrays, as the clamp
    (nondecreasing within [0, M]) says."""
    check(20, 33, 40, [0, 0, 0], jnp.float32, seed=1, group_end=group_end)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_is_the_same_contract(dtype):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((25, 40)), DTYPES[dtype])
    w = jnp.asarray(rng.standard_normal((4, 40, 50)) * 0.1, DTYPES[dtype])
    ends = jnp.asarray([6, 6, 20, 22], jnp.int32)
    np.testing.assert_allclose(np.asarray(grouped_gemm_reference(x, w, ends)),
                               np.asarray(jax.jit(grouped_gemm)(x, w, ends)),
                               rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_value_errors():
    x, w = jnp.zeros((4, 8), jnp.float32), jnp.zeros((2, 8, 16), jnp.float32)
    ends = jnp.asarray([2, 4], jnp.int32)
    with pytest.raises(ValueError, match="disagree on K or E"):
        grouped_gemm(x, jnp.zeros((2, 9, 16), jnp.float32), ends)
    with pytest.raises(ValueError, match="disagree on K or E"):
        grouped_gemm(x, w, jnp.asarray([4], jnp.int32))
    with pytest.raises(ValueError, match="x is bfloat16 but w is float32"):
        grouped_gemm(x.astype(jnp.bfloat16), w, ends)
    with pytest.raises(ValueError, match="group_end must be int32"):
        grouped_gemm(x, w, ends.astype(jnp.float32))
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
        grouped_gemm(x, w, ends, jnp.float16)


def test_a_library_without_the_grouped_gemm_is_unavailable_and_says_why(monkeypatch):
    """A cpu_gemm library built before the grouped GEMM: the "cpu" method (which needs both)
    is unavailable, with the reason its fallback warning gives."""
    old = native_library.Availability(types.SimpleNamespace(JaxllmCpuGemm=object()), "")
    monkeypatch.setattr(native_library, "open_library", lambda *args: old)
    for fn in (cpu_gemm.availability, cpu_gemm._library):
        fn.cache_clear()
    try:
        status = cpu_gemm.availability(jnp.float32)
        assert not status
        assert "has no JaxllmCpuGroupedGemm (built from an older cpu_gemm.cc: rebuild it" in (
            status.reason)
    finally:
        for fn in (cpu_gemm.availability, cpu_gemm._library):
            fn.cache_clear()
