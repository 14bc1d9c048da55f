"""kernels/hlo_text.py on small CPU programs: the whole-cache-copy check tells a weight that
has a cache's element count from a cache, and still catches a cache that is not donated."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels import hlo_text

sds = jax.ShapeDtypeStruct
CACHE = sds((4, 4, 1, 4), jnp.float32)  # 64 elements
WEIGHT = sds((16, 4), jnp.float32)  # 64 elements too, never donated


def _step(cache, weight, x, slot):
    cache = cache.at[slot // 4, slot % 4].set((x @ weight.T)[:, None, :4])
    return cache, x @ weight.T


def _problems(donate):
    compiled = jax.jit(_step, donate_argnums=donate).lower(
        CACHE, WEIGHT, sds((2, 4), jnp.float32), sds((2,), jnp.int32)).compile()
    return hlo_text.full_cache_copies(compiled.as_text(), compiled.memory_analysis(), [CACHE])


def test_a_weight_with_the_cache_element_count_is_not_a_cache():
    assert _problems(donate=(0,)) == []


def test_a_cache_that_is_not_donated_is_reported():
    problems = _problems(donate=())
    assert any("parameter 0 (f32[4,4,1,4]) is not aliased" in p for p in problems), problems
    assert not any("f32[16,4]" in p for p in problems), problems
