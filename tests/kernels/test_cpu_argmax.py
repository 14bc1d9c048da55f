"""The C++ greedy top-1 (kernels/cpu_argmax.py, csrc/cpu_argmax.cc) and the sampler's use.

The oracle is numpy on the float32 bits: each value's key in IEEE total order (bits b as
int64: b for b >= 0, b ^ 0x7fffffff below), then np.argmax (its first index). The kernel must
equal it, and top_k (the XLA reference), on every row: NaNs of either sign and any payload,
signed zeros, infinities, ties, rows whose length is not a multiple of the 64-lane loop (the
masked tail) and rows shorter than one vector. The library's scalar loop is checked the same.
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import cpu_argmax
from platform_choice import ON_GPU

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="setup.py builds the cpu argmax library on Linux only"),
    pytest.mark.skipif(ON_GPU, reason="the C++ argmax runs on the CPU platform"),
    pytest.mark.skipif(not cpu_argmax.available(), reason=f"{cpu_argmax.available().reason}"),
]


def oracle(x_SV: np.ndarray) -> list[int]:
    bits = x_SV.view(np.int32).astype(np.int64)
    keys = np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return np.argmax(keys, axis=-1).tolist()


def floats(*bit_patterns) -> np.ndarray:
    return np.array(bit_patterns, np.uint32).view(np.float32)


SPECIAL = np.concatenate([
    np.array([np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-45, -1e-45],
             np.float32),
    floats(0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0xFF800001),  # NaNs
])


def adversarial_rows(rng, V: int, S: int) -> np.ndarray:
    """Rows of few distinct values (many ties), specials scattered, the maximum placed at the
    first, the last, and the tail's positions."""
    x = rng.choice(np.concatenate([SPECIAL, np.float32([2.0, 2.0, -5.0])]), (S, V))
    x = x.astype(np.float32)
    x[0] = -np.inf                                    # all equal: index 0
    if S > 1:
        x[1] = floats(0xFFFFFFFF)[0]                  # all the smallest key (-NaN, all ones)
    if S > 2:
        x[2] = rng.integers(-2, 2, V).astype(np.float32)
        x[2, V - 1] = 9.0                             # the maximum in the last place
    if S > 3:
        x[3] = np.float32(-0.0)
        x[3, V // 2] = np.float32(0.0)                # +0 above -0
    return x


def run(x_SV: np.ndarray):
    kernel = jax.jit(cpu_argmax.argmax_first)(jnp.asarray(x_SV))
    reference = jax.jit(cpu_argmax.argmax_first_reference)(jnp.asarray(x_SV))
    return kernel.tolist(), reference.tolist()


@pytest.mark.parametrize("V", [1, 2, 15, 16, 17, 63, 64, 65, 127, 300, 1000, 49152])
def test_matches_the_total_order_oracle_and_top_k(V):
    rng = np.random.default_rng(V)
    for x in (adversarial_rows(rng, V, 9),
              rng.standard_normal((5, V)).astype(np.float32)):
        want = oracle(x)
        kernel, reference = run(x)
        assert kernel == want
        assert reference == want  # top_k's order is the total order


def test_rows_spread_over_the_pool():
    """Enough elements to wake the pool (S * V >= 2^18), rows not a multiple of an item."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((67, 5003)).astype(np.float32)
    x[rng.integers(0, 67, 20), rng.integers(0, 5003, 20)] = np.nan
    assert run(x)[0] == oracle(x)


def test_the_librarys_scalar_loop_agrees():
    rng = np.random.default_rng(1)
    scalar = cpu_argmax.available().lib.JaxllmCpuArgmaxScalar
    for V in (1, 7, 64, 301):
        for row in adversarial_rows(rng, V, 6):
            row = np.ascontiguousarray(row)
            assert scalar(row.ctypes.data, V) == oracle(row[None])[0]


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="float32"):
        cpu_argmax.argmax_first(jnp.zeros((2, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        cpu_argmax.argmax_first(jnp.zeros((2, 0), jnp.float32))
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        cpu_argmax.argmax_first(jnp.zeros((4,), jnp.float32))


def test_the_sampler_uses_it_on_cpu():
    from jaxllm.runner.sampler import argmax_first

    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 100)).astype(np.float32))
    text = jax.jit(argmax_first).lower(x).as_text()
    assert cpu_argmax.TARGET in text and "topk" not in text.lower()


def test_without_the_library_the_sampler_says_why_once_and_picks_the_same(monkeypatch):
    from jaxllm.runner import sampler
    missing = cpu_argmax.Availability(None, "the library is gone (test)")
    monkeypatch.setattr(cpu_argmax, "available", lambda: missing)
    cpu_argmax.warn_unavailable.cache_clear()
    x_SV = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50)), jnp.float32)
    with pytest.warns(UserWarning, match=r"unavailable \(the library is gone \(test\)\)"):
        first = sampler.argmax_first(x_SV)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = sampler.argmax_first(x_SV)
    cpu_argmax.warn_unavailable.cache_clear()
    assert first.tolist() == second.tolist() == oracle(np.asarray(x_SV))
