"""The kernel lowers to a CUDA Triton custom call for every static variant (no GPU needed).

`jax.export` for platforms=["cuda"] runs the Pallas -> Triton IR lowering, which rejects what
the interpreter accepts but Triton cannot express (non-power-of-two blocks, unsupported index
forms, dtype casts). Compiling that IR for real targets is `test_gpu_compile.py`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxllm.kernels import paged_attention as pa

_TRITON = "__gpu$xla.gpu.triton"
# name: (T, S) and forced tuning; Llama-3-8B-like heads (Hq 32, Hkv 8), block 16.
VARIANTS = {
    "decode": (64, 64, {"num_kv_splits": 1}),
    "prefill": (512, 8, {"num_kv_splits": 1}),
    "split": (8, 8, {}),  # few long sequences: the split-KV grid is the automatic choice
}
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, HQ, HKV = 1024, 16, 128, 32, 8


def specs(T, S, D, dtype):
    sds = jax.ShapeDtypeStruct
    cache = sds((NUM_BLOCKS, BLOCK_SIZE, HKV, D), dtype)
    return (sds((T, HQ, D), dtype), cache, cache, sds((S, MAX_BLOCKS), jnp.int32),
            sds((S,), jnp.int32), sds((S + 1,), jnp.int32), sds((), jnp.int32))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exports_for_cuda(variant, dtype, D):
    T, S, tuning = VARIANTS[variant]
    args = specs(T, S, D, jnp.dtype(dtype))
    st, num_warps, num_stages = pa.plan(args[0].shape, args[1].shape, args[3].shape,
                                        jnp.dtype(dtype), target="h100", **tuning)
    assert (st.num_splits > 1) == (variant == "split")
    fn = jax.jit(lambda *a: pa.ragged_paged_attention(*a, sm_scale=D ** -0.5, target="h100",
                                                      **tuning))
    exported = jax.export.export(
        fn, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)])(*args)

    assert exported.out_avals == (jax.core.ShapedArray((T, HQ, D), jnp.dtype(dtype)),)
    text = exported.mlir_module()
    calls = [line for line in text.splitlines() if f"custom_call @{_TRITON}" in line]
    assert len(calls) == 1, "one kernel launch per call"
    config = calls[0]
    grid = tuple(int(re.search(rf"grid_{a} = (\d+)", config).group(1)) for a in "xyz")
    assert grid == (pl_cdiv(T, st.q_tile) + S, HKV, st.num_splits)
    assert f'name = "ragged_paged_attention_{"split" if st.num_splits > 1 else "plain"}' in config
    assert f"num_warps = {num_warps} : i32" in config
    assert f"num_stages = {num_stages} : i32" in config


def pl_cdiv(a, b):
    return -(-a // b)
