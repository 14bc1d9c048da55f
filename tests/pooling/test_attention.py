"""Pooling attention (jaxllm/pooling/attention.py): the tiled form equals the whole-step form,
and both equal a float64 per-prompt oracle, bidirectional and causal, with GQA and padding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.pooling.attention import DenseAttention, Tiling
from jaxllm.pooling.runner import PoolingInput, _pack

T, S, N, K, H, L = 256, 256, 4, 2, 8, 32
LENS = [32, 1, 17, 32, 9, 30, 31, 2, 25, 32, 20, 5]  # 236 rows: prompts across tile edges


def oracle(q, k, v, lens, causal):
    out = np.zeros_like(q)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        kk, vv = (np.repeat(x[sl], N // K, axis=1) for x in (k, v))
        s = np.einsum("tnh,snh->nts", q[sl], kk) * H ** -0.5
        if causal:
            s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[sl] = np.einsum("nts,snh->tnh", p, vv)
        start += n
    return out, start


def test_tiling_has_the_fewest_keys_per_query():
    assert Tiling.for_max_model_len(32) == Tiling(32, 1)  # 96 keys
    assert Tiling.for_max_model_len(128) == Tiling(32, 4)  # 288 keys, not 3 * 128
    assert Tiling.for_max_model_len(256).keys_per_query() == 544
    assert Tiling.for_max_model_len(20) == Tiling(32, 1)


@pytest.mark.parametrize("causal, tiling", [(False, Tiling(32, 1)), (True, Tiling(32, 1)),
                                            (False, Tiling(16, 2))])
def test_tiled_equals_whole_step_and_oracle(causal, tiling):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((T, n, H)) for n in (N, K, K))
    md = _pack([PoolingInput(tuple([1] * n)) for n in LENS], T, S)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    tiled, _ = DenseAttention(causal, tiling)(*args, None, md, sm_scale=H ** -0.5)
    whole, _ = DenseAttention(causal, None)(*args, None, md, sm_scale=H ** -0.5)
    ref, used = oracle(q, k, v, LENS, causal)
    assert np.isfinite(np.asarray(tiled)).all()  # padding rows too
    np.testing.assert_allclose(np.asarray(tiled)[:used], ref[:used], atol=1e-5)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(whole), atol=1e-6)
