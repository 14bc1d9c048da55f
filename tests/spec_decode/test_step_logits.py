"""runner/step.py step_logits: the LM head once per step where a feature reads more rows
than the sampled ones (speculative verification), and the sampled rows' logits exactly as
the plain step computes them (the sampler must see the same numbers either way)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import cpu_gemm
from jaxllm.runner.step import step_logits
from jaxllm.runner.step_features import StepFeature

D, V = 96, 200


class ReadsRows(StepFeature):
    reads_row_logits = True


def heads():
    """The LM heads the engine runs on CPU: XLA's dot and, where it is built, the C++ GEMM
    on packed weights."""
    w_DV = jax.random.normal(jax.random.key(1), (D, V), jnp.float32).astype(jnp.bfloat16)
    out = {"xla": lambda h: jnp.einsum("sd,dv->sv", h.astype(w_DV.dtype), w_DV,
                                       preferred_element_type=jnp.float32)}
    if cpu_gemm.availability(jnp.bfloat16):
        packed = cpu_gemm.pack(w_DV)
        out["cpu_gemm"] = lambda h: cpu_gemm.gemm(h.astype(jnp.bfloat16), packed, V)
    return out


@pytest.mark.parametrize("name", sorted(heads()))
def test_sampled_rows_are_the_plain_steps_and_rows_run_once(name):
    logits_fn = heads()[name]
    calls = []

    def counted(h_ND):
        calls.append(h_ND.shape[0])
        return logits_fn(h_ND)

    hidden_TD = jax.random.normal(jax.random.key(0), (8, D), jnp.float32)
    idx_S = jnp.array([4, 7, 0, 0, 0, 0, 0, 0], jnp.int32)  # two sequences, padding reads 0
    plain_TV, plain_SV = jax.jit(lambda h, i: step_logits(counted, h, i))(hidden_TD, idx_S)
    assert plain_TV is None and calls == [8]
    calls.clear()
    rows_TV, rows_SV = jax.jit(lambda h, i: step_logits(counted, h, i, (ReadsRows(),)))(
        hidden_TD, idx_S)
    assert calls == [8]  # once, over every packed row (T == S: as many as the sampled)
    np.testing.assert_array_equal(np.asarray(rows_SV), np.asarray(plain_SV))
    np.testing.assert_array_equal(np.asarray(rows_TV)[np.asarray(idx_S)], np.asarray(plain_SV))
    # T > S (a bucket past max_num_seqs): the sampled rows only; features use logits_fn.
    calls.clear()
    big_TV, big_SV = jax.jit(lambda h, i: step_logits(counted, h, i, (ReadsRows(),)))(
        hidden_TD, idx_S[:4])
    assert big_TV is None and calls == [4]
    np.testing.assert_array_equal(np.asarray(big_SV), np.asarray(plain_SV)[:4])
