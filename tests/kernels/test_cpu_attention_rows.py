"""Row invariance of backend "cpu" (kernels/csrc/cpu_attention.cc): a query row's output has
the same bits whatever the other rows of the call, so that a verify step (1 + k rows of a
sequence, padded to 8) computes what plain decode steps (1 row, padded to 2) compute, and
greedy speculative decoding gives plain decoding's tokens.

The same row at position p, against the same cache, is run
  * alone (1 row, T = 2): the pool splits its long key range over the threads;
  * first and last of a 5-row verify group (T = 8): its tile's key range ends elsewhere;
  * inside a 40-row prefill chunk (16-row tiles);
  * among 15 other sequences with long contexts (T = 32): enough items that none is split;
with and without a sliding window, for contexts of 1 to 4 key chunks (the kernel's chunk
grid is 256 keys), in float32 (every bit of the sum shows) and bfloat16. Its output must be
bit-identical in every layout. (The pool has one thread per CPU: the lone row is split only
with 2 or more.)
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import cpu_attention
from platform_choice import ON_GPU

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="setup.py builds the cpu backend on Linux only"),
    pytest.mark.skipif(ON_GPU, reason='the "cpu" backend runs on the CPU platform')]

N, K, H, P = 8, 2, 64, 16
MAX_BLOCKS = 64  # per sequence: 1024 positions
NUM_SEQS = 16


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def setup(request):
    dtype = jnp.dtype(request.param)
    rng = np.random.default_rng(0)
    shape = (NUM_SEQS * MAX_BLOCKS + 1, P, K, H)
    k_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    v_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    # Sequence i owns blocks 1 + i * MAX_BLOCKS ..., in a scrambled order.
    tables = np.stack([1 + i * MAX_BLOCKS + rng.permutation(MAX_BLOCKS)
                       for i in range(NUM_SEQS)]).astype(np.int32)
    q_row = jnp.asarray(rng.standard_normal((N, H)), dtype)  # the row under test
    return dtype, k_cache, v_cache, tables, q_row, rng


def run_row(setup, T, seqs, row, window):
    """seqs: (q_len, seq_len, block table) per sequence, packed in order into T rows (the
    rest padding), random queries but the row under test at packed row `row`: its output."""
    dtype, k_cache, v_cache, tables, q_row, rng = setup
    qsl = np.concatenate([[0], np.cumsum([s[0] for s in seqs])]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((T, N, H)), dtype).at[row].set(q_row)
    out = cpu_attention.ragged_paged_attention(
        q, k_cache, v_cache, tables[[s[2] for s in seqs]],
        np.array([s[1] for s in seqs], np.int32), qsl, len(seqs), sm_scale=H ** -0.5,
        sliding_window=window)
    return np.asarray(out[row].astype(jnp.float32))


@pytest.mark.parametrize("window", [None, 100])
def test_a_row_gives_the_same_bits_whatever_the_other_rows(setup, window):
    others = [(1, 900 - 13 * i, i) for i in range(1, NUM_SEQS)]  # long decode rows
    for p in (40, 173, 300, 545, 800):
        layouts = {
            "alone": (2, [(1, p + 1, 0)], 0),
            "first of 5": (8, [(5, p + 5, 0)], 0),
            "last of 5": (8, [(5, p + 1, 0)], 4),
            "prefill chunk": (40, [(40, p + 21, 0)], 19),
            "among 15": (32, others[:7] + [(1, p + 1, 0)] + others[7:], 7),
        }
        ref = None
        for name, (T, seqs, row) in layouts.items():
            got = run_row(setup, T, seqs, row, window)
            assert np.isfinite(got).all()
            if ref is None:
                ref = got
            assert np.array_equal(got, ref), (
                f"position {p}: the row {name} differs from the row alone by up to "
                f"{np.abs(got - ref).max()}")

