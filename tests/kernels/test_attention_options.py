"""The attention options (sliding_window, logits_soft_cap; kernels/reference.py) through the
reference kernel and the backend interface: the reference against the float64 oracle, with
NaN in every slot before each window; a backend asked for an option it lacks refuses it by
name; `AttentionLayer` hands the options to the kernel (its output is the kernel's own).
The kernels' own tests (test_xla_attention.py, test_cpu_attention.py, test_paged_attention.py)
cover the options on their work decompositions."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import backends, reference
from jaxllm.models.base import AttentionMetadata
from oracle import Batch, Shape, check, make_inputs, run
from platform_choice import ON_GPU

SHAPE = Shape(T=16, S=4, max_blocks=12, Hkv=2, G=2, D=64, dtype="float32",
              sliding_window=21, logits_soft_cap=2.0)


@functools.cache
def reference_fn(shape: Shape):
    return jax.jit(functools.partial(reference.ragged_paged_attention,
                                     sm_scale=shape.D ** -0.5, **shape.options))


@pytest.mark.parametrize("shape", [SHAPE, Shape(T=16, S=4, max_blocks=12, Hkv=2, G=2, D=64,
                                                dtype="float32", sliding_window=1)],
                         ids=["w21-cap", "w1"])
def test_reference_matches_float64(shape):
    check(reference_fn(shape), shape, Batch(q_lens=(1, 7, 1, 6), ctx_lens=(0, 40, 150, 15),
                                            seed=21))


class _Plain(backends.XlaBackend):
    name = "plain"
    supports_sliding_window = supports_logits_soft_cap = False


@pytest.mark.parametrize("option,value", [("sliding_window", 8), ("logits_soft_cap", 30.0)])
def test_backend_refuses_an_option_it_lacks(option, value):
    layer = backends.AttentionLayer(_Plain())
    with pytest.raises(ValueError, match=f'attention backend "plain" does not support '
                                         f'{option} \\(got {value}\\)'):
        layer(None, None, None, None, None, sm_scale=1.0, **{option: value})


@pytest.mark.parametrize("option,value", [("sliding_window", 0), ("sliding_window", 8.0),
                                          ("logits_soft_cap", 0.0), ("logits_soft_cap", "1")])
def test_option_values_are_checked(option, value):
    with pytest.raises(ValueError, match=f"{option} must be"):
        backends.get_backend("xla").check_options(**{option: value})


@pytest.mark.skipif(ON_GPU, reason='the "cpu" backend runs on the CPU platform')
def test_layer_passes_the_options_to_the_kernel():
    # Without the window the kernel would read the NaN slots before it.
    shape = SHAPE
    inputs = {k: jnp.asarray(v) for k, v in make_inputs(shape, Batch(
        q_lens=(3, 1), ctx_lens=(30, 60), seed=22)).items()}
    # Write the new rows' K/V (here: the ones already cached) back through the layer.
    T, (_, P, K, H) = shape.T, inputs["k_cache"].shape
    slots = np.zeros(T, np.int32)  # padding rows write the null block
    qsl, sl, bt = (np.asarray(inputs[k]) for k in ("query_start_loc", "seq_lens",
                                                    "block_tables"))
    for s in range(2):
        pos = np.arange(sl[s] - (qsl[s + 1] - qsl[s]), sl[s])
        slots[qsl[s]:qsl[s + 1]] = bt[s, pos // P] * P + pos % P
    k_new = inputs["k_cache"].reshape(-1, K, H)[slots]
    v_new = inputs["v_cache"].reshape(-1, K, H)[slots]
    md = AttentionMetadata(input_ids=jnp.zeros(T, jnp.int32), positions=jnp.zeros(T, jnp.int32),
                           slot_mapping=jnp.asarray(slots), block_tables=inputs["block_tables"],
                           seq_lens=inputs["seq_lens"], query_start_loc=inputs["query_start_loc"],
                           num_seqs=inputs["num_seqs"])
    # "cpu": its kernel compiles at once (the "xla" one would add a compile of its own).
    layer = backends.AttentionLayer(backends.get_backend("cpu"))
    out, _ = jax.jit(functools.partial(layer, sm_scale=shape.D ** -0.5, **shape.options))(
        inputs["q"], k_new, v_new, (inputs["k_cache"], inputs["v_cache"]), md)
    want = run(reference_fn(shape), {k: np.asarray(v) for k, v in inputs.items()})
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
