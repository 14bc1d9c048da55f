"""Pooling attention (jaxllm/pooling/attention.py): the block-diagonal form equals the
whole-step form, and both equal a float64 per-prompt oracle, bidirectional and causal, with
GQA, padding between prompts and a step that is no multiple of the block; first-fit packing
places prompts as its docstring says, and never across a block edge."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.pooling.attention import BlockPacking, DenseAttention, Tiling
from jaxllm.pooling.runner import PoolingInput, _pack

S, N, K, H, L = 256, 4, 2, 8, 32
LENS = [32, 1, 17, 32, 9, 30, 31, 2, 25, 32, 20, 5]  # 236 rows, packed into blocks of 32


def oracle(q, k, v, lens, starts, causal):
    out = np.zeros_like(q)
    for n, start in zip(lens, starts):
        sl = slice(start, start + n)
        kk, vv = (np.repeat(x[sl], N // K, axis=1) for x in (k, v))
        s = np.einsum("tnh,snh->nts", q[sl], kk) * H ** -0.5
        if causal:
            s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[sl] = np.einsum("nts,snh->tnh", p, vv)
    return out


def test_block_is_the_smallest_power_of_two_holding_a_prompt():
    assert Tiling.for_max_model_len(32) == Tiling(32)
    assert Tiling.for_max_model_len(128) == Tiling(128)
    assert Tiling.for_max_model_len(129) == Tiling(256)
    assert Tiling.for_max_model_len(20) == Tiling(32)


def test_first_fit_packing():
    p = BlockPacking(4, 2)
    assert [p.add(3), p.add(3), p.add(1), p.add(2)] == [0, 4, 3, None]
    assert p.end() == 7
    # a budget below one block is one short block
    short = BlockPacking.for_budget(Tiling(128), 100)
    assert (short.block, short.used) == (100, [0])
    assert BlockPacking.for_budget(Tiling(32), 300).used == [0] * 9


@pytest.mark.parametrize("causal, block, T", [(False, 32, 320), (True, 32, 320),
                                              (False, 64, 320), (True, 16, 256)])
def test_blocks_equal_whole_step_and_oracle(causal, block, T):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((T, n, H)) for n in (N, K, K))
    lens = [min(n, block) for n in LENS]
    packing = BlockPacking.for_budget(Tiling(block), T)
    starts = [packing.add(n) for n in lens]
    assert None not in starts and all(s // block == (s + n - 1) // block
                                      for s, n in zip(starts, lens))
    md = _pack([PoolingInput(tuple([1] * n)) for n in lens], T, S, starts)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    blocked, _ = DenseAttention(causal, Tiling(block))(*args, None, md, sm_scale=H ** -0.5)
    whole, _ = DenseAttention(causal, None)(*args, None, md, sm_scale=H ** -0.5)
    ref = oracle(q, k, v, lens, starts, causal)
    rows = np.asarray(md.seq_ids) < S
    assert np.isfinite(np.asarray(blocked)).all()  # padding rows too
    np.testing.assert_allclose(np.asarray(blocked)[rows], ref[rows], atol=1e-5)
    # (padding rows differ: a block's padding sees only that block's padding)
    np.testing.assert_allclose(np.asarray(blocked)[rows], np.asarray(whole)[rows], atol=1e-6)
