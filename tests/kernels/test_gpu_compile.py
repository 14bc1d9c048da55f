"""Compile the kernel, and steps that use it, for the GPU targets of jaxllm/kernels/targets.

XLA's real GPU pipeline runs here without a GPU (see jaxllm/kernels/gpu_compile.py): Triton
lowers each variant to PTX, ptxas assembles it for sm_90a / sm_80 / sm_89. The full matrix of
variants, dtypes and head sizes runs on the H100 and A100, whose tiles were tuned; the L4 and
H200, which borrow the A100's and H100's tiles, get every variant at head size 128. Checked per
kernel: it
compiles (shared memory within the target's opt-in limit, else Triton/XLA refuses), no
register spill, registers fit a block, tensor-core mma instructions present. Checked per
step: a donated cache is updated in place (no full-cache copy).

Works with or without JAX_PLATFORMS=cpu in the environment (gpu_compile registers the CUDA
plugin itself if the CUDA version check made jax skip it at start-up).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs jax-cuda12-plugin (gpu-compile extra)")

from jaxllm.kernels import gpu_compile as gc  # noqa: E402
from jaxllm.kernels import paged_attention as pa  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.gpu_compile]

TARGETS = ["h100", "a100"]  # tuned targets: the full matrix below
BORROWING_TARGETS = ["l4", "h200"]  # tiles borrowed from a100 / h100 (kernels/tuning.py)
HQ, HKV, BLOCK_SIZE = 32, 8, 16  # Llama-3-8B attention
VARIANTS = {  # name: (T, S, max_blocks, forced tuning)
    "decode": (64, 64, 128, {"num_kv_splits": 1}),
    "prefill": (512, 8, 128, {"num_kv_splits": 1}),
    "split": (8, 8, 256, {}),
}
sds = jax.ShapeDtypeStruct


def attention_specs(T, S, max_blocks, D, dtype, num_blocks=2048):
    cache = sds((num_blocks, BLOCK_SIZE, HKV, D), dtype)
    return [sds((T, HQ, D), dtype), cache, cache, sds((S, max_blocks), jnp.int32),
            sds((S,), jnp.int32), sds((S + 1,), jnp.int32), sds((), jnp.int32)]


# Gemma-2/3-like attention options (kernels/reference.py): the window-edge chunk loop and the
# tanh of the soft cap must lower too.
WINDOWED = dict(sliding_window=4096, logits_soft_cap=50.0)


@functools.cache
def compiled_kernel(target, variant, dtype, D, options=(), **extra):
    T, S, max_blocks, tuning = VARIANTS[variant]
    tuning = {**tuning, **extra}
    fn = jax.jit(lambda *a: pa.ragged_paged_attention(*a, sm_scale=D ** -0.5, target=target,
                                                      **tuning, **dict(options)))
    return gc.compile_for_target(fn, attention_specs(T, S, max_blocks, D, jnp.dtype(dtype)),
                                 target)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("target", TARGETS)
def test_kernel_compiles_clean(target, variant, dtype, D):
    assert_compiles_clean(target, variant, dtype, D)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("target", BORROWING_TARGETS)
def test_borrowed_tiles_compile_clean(target, variant, dtype):
    # The "split" shape keeps an L4's 58 SMs busy unsplit (64 programs); force the split kernel.
    extra = {"num_kv_splits": 4} if variant == "split" else {}
    assert_compiles_clean(target, variant, dtype, 128, **extra)


# The A100 decode tile is the one that spilled with libdevice's tanh; the H100 prefill tile
# is the wgmma one. (The split grid runs the same chunk loops; test_paged_attention.py runs
# it windowed in the interpreter.)
@pytest.mark.parametrize("target,variant", [("a100", "decode"), ("h100", "prefill")])
def test_window_and_soft_cap_compile_clean(target, variant):
    assert_compiles_clean(target, variant, "bfloat16", 128, options=tuple(WINDOWED.items()))


def assert_compiles_clean(target, variant, dtype, D, options=(), **extra):
    result = compiled_kernel(target, variant, dtype, D, options, **extra)
    kind = "split" if variant == "split" else "plain"
    kernel = result.kernel(f"ragged_paged_attention_{kind}")
    assert gc.kernel_problems(result, kernel) == []
    assert kernel.registers > 0 and kernel.spill_store_bytes == 0 == kernel.spill_load_bytes
    assert kernel.cp_async_instructions > 0, "K/V loads should be pipelined (cp.async)"
    T, S, max_blocks, tuning = VARIANTS[variant]
    st, num_warps, _ = pa.plan((T, HQ, D), (2048, BLOCK_SIZE, HKV, D), (S, max_blocks),
                               jnp.dtype(dtype), target=target, **{**tuning, **extra})
    assert kernel.threads == (32 * num_warps, 1, 1)
    assert kernel.grid == (-(-T // st.q_tile) + S, HKV, st.num_splits)


@pytest.mark.parametrize("target,hopper", [("h100", True), ("h200", True), ("a100", False),
                                           ("l4", False)])
def test_tall_prefill_tile_uses_wgmma_on_hopper_only(target, hopper):
    # The same arguments as assert_compiles_clean's call: one cached compile per kernel (a
    # second deviceless compile would read JAX's persistent cache, which needs a client).
    result = compiled_kernel(target, "prefill", "bfloat16", 128, ())
    ptx = result.ptx[result.kernel("ragged_paged").name]
    assert ("wgmma.mma_async" in ptx) == hopper
    assert hopper or "mma.sync" in ptx


def test_checker_catches_spills():
    # 3xTF32 f32 dots over a 64-row tile need more than 255 registers per thread.
    with pytest.raises(Exception, match="(?i)spill"):
        compiled_kernel("h100", "prefill", "float32", 128, block_m=64, num_stages=3)
    fn = jax.jit(lambda *a: pa.ragged_paged_attention(
        *a, sm_scale=0.1, target="h100", num_kv_splits=1, block_m=64, num_stages=3))
    result = gc.compile_for_target(fn, attention_specs(512, 8, 128, 128, jnp.float32), "h100",
                                   fail_on_spills=False)
    kernel = result.kernel("ragged_paged")
    assert kernel.spill_store_bytes > 0
    assert any("spills" in p for p in gc.kernel_problems(result, kernel))


def test_shared_memory_overflow_is_rejected():
    # 256-key f32 K and V chunks, several stages deep: ~300 KB of shared memory > 163 KB.
    with pytest.raises(Exception, match="(?i)shared memory|smem|out of resource"):
        compiled_kernel("a100", "prefill", "float32", 128, block_n=256, num_stages=4)


# ------------------------------------------------------- whole steps: in-place cache update


def scatter_and_attend(q, k_new, v_new, k_cache, v_cache, slot_mapping, block_tables,
                       seq_lens, query_start_loc, num_seqs, *, target):
    # q [T, Hq, D]; k_new/v_new [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D];
    # slot_mapping [T] (padding rows -> slots of the null block 0).
    nb, bs, hkv, d = k_cache.shape
    k_cache = k_cache.reshape(nb * bs, hkv, d).at[slot_mapping].set(k_new).reshape(k_cache.shape)
    v_cache = v_cache.reshape(nb * bs, hkv, d).at[slot_mapping].set(v_new).reshape(v_cache.shape)
    out = pa.ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                    query_start_loc, num_seqs, sm_scale=d ** -0.5, target=target)
    return out, k_cache, v_cache


def toy_step_specs(T=64, S=64, D=128, num_blocks=4096, dtype=jnp.bfloat16):
    cache = sds((num_blocks, BLOCK_SIZE, HKV, D), dtype)
    return [sds((T, HQ, D), dtype), sds((T, HKV, D), dtype), sds((T, HKV, D), dtype), cache,
            cache, sds((T,), jnp.int32), sds((S, 128), jnp.int32), sds((S,), jnp.int32),
            sds((S + 1,), jnp.int32), sds((), jnp.int32)]


@pytest.mark.parametrize("target", TARGETS)
def test_toy_step_updates_donated_cache_in_place(target):
    specs = toy_step_specs()
    step = jax.jit(functools.partial(scatter_and_attend, target=target), donate_argnums=(3, 4))
    result = gc.compile_for_target(step, specs, target)
    assert gc.full_cache_copies(result, specs[3:5]) == []
    assert gc.kernel_problems(result, result.kernel("ragged_paged")) == []


def test_full_cache_copy_is_detected_without_donation():
    specs = toy_step_specs()
    step = jax.jit(functools.partial(scatter_and_attend, target="h100"))
    problems = gc.full_cache_copies(gc.compile_for_target(step, specs, "h100"), specs[3:5])
    assert any("not aliased" in p for p in problems)
    assert any("full-cache copy" in p for p in problems)


def test_full_pass_over_donated_cache_is_detected():
    # Donated, but every element is rewritten (a loop fusion over the whole cache).
    def rescale_then_scatter(k_cache, v_cache, slot_mapping, k_new):
        nb, bs, hkv, d = k_cache.shape
        k_cache = (k_cache * 1.5).astype(k_cache.dtype)
        k_cache = k_cache.reshape(nb * bs, hkv, d).at[slot_mapping].set(k_new)
        return k_cache.reshape(nb, bs, hkv, d), v_cache

    specs = toy_step_specs()
    args = [specs[3], specs[4], specs[5], specs[1]]
    step = jax.jit(rescale_then_scatter, donate_argnums=(0, 1))
    problems = gc.full_cache_copies(gc.compile_for_target(step, args, "a100"), args[:2])
    assert len(problems) == 1 and "full pass" in problems[0]


def llama3_8b_layer(x, wqkv, wo, caches, positions_unused, slot_mapping, block_tables,
                    seq_lens, query_start_loc, num_seqs, *, target):
    # x [T, 4096]; wqkv [4096, (32 + 8 + 8) * 128]; wo [32 * 128, 4096];
    # caches: ((k, v),) per layer, each [num_blocks, 16, 8, 128].
    del positions_unused  # RoPE is not what this checks
    T = x.shape[0]
    qkv = x @ wqkv  # [T, 6144]
    q = qkv[:, :HQ * 128].reshape(T, HQ, 128)
    k_new = qkv[:, HQ * 128:(HQ + HKV) * 128].reshape(T, HKV, 128)
    v_new = qkv[:, (HQ + HKV) * 128:].reshape(T, HKV, 128)
    new_caches, h = [], x
    for k_cache, v_cache in caches:
        out, k_cache, v_cache = scatter_and_attend(q, k_new, v_new, k_cache, v_cache,
                                                   slot_mapping, block_tables, seq_lens,
                                                   query_start_loc, num_seqs, target=target)
        h = h + out.reshape(T, HQ * 128) @ wo  # [T, 4096]
        new_caches.append((k_cache, v_cache))
    return h, tuple(new_caches)


@pytest.mark.parametrize("T,S", [(64, 64), (512, 8)], ids=["decode", "prefill"])
@pytest.mark.parametrize("target", TARGETS)
def test_llama3_8b_shaped_step_has_no_full_cache_copy(target, T, S):
    bf16 = jnp.bfloat16
    cache = sds((4096, BLOCK_SIZE, HKV, 128), bf16)
    caches = ((cache, cache), (cache, cache))  # two layers sharing the projections
    specs = [sds((T, 4096), bf16), sds((4096, (HQ + 2 * HKV) * 128), bf16),
             sds((HQ * 128, 4096), bf16), caches, sds((T,), jnp.int32), sds((T,), jnp.int32),
             sds((S, 128), jnp.int32), sds((S,), jnp.int32), sds((S + 1,), jnp.int32),
             sds((), jnp.int32)]
    step = jax.jit(functools.partial(llama3_8b_layer, target=target), donate_argnums=(3,))
    result = gc.compile_for_target(step, specs, target)
    assert gc.full_cache_copies(result, caches) == []
    kernels = [k for k in result.kernels if k.name.startswith("ragged_paged")]
    assert len(kernels) == 2
    for kernel in kernels:
        assert gc.kernel_problems(result, kernel) == []
