"""Batched multi-LoRA on CPU: a C++ XLA FFI call that adds each token's own adapter's delta
to a dense layer's output, the adapters' weight tables read in place (SGMV-style).

Owns: its library (opened through native_library.py), built from kernels/csrc/cpu_lora.cc
(setup.py), registering its handler with XLA once, `lora_apply`, a validated wrapper, and
`lora_apply_reference`, the same in plain XLA with the same signature (tests only).
`availability(dtype)` says whether the kernel can run here for tables of that dtype, and why
not; `warn_unavailable` says it once. Must never: be used under tensor parallelism (an FFI
call is opaque to the SPMD partitioner: lora/feature.py keeps XLA there) or on a platform
other than cpu; run on a CPU without AVX-512F, or without AVX512-BF16 when it was built with it (the
library is compiled with -march=native; bf16 tables multiply in pairs by vdpbf16ps).

    x [T, K]   y [T, N]   A [S, L, K, R]   B [S, L, R, N]   m [T] int32

    y'[t] = y[t] + round_w(x[t] @ A[m_t, layer]) @ B[m_t, layer]   if 0 <= m_t < num_adapters
    y'[t] = y[t]                                                    otherwise (no adapter)

x, A and B of one dtype (float32 or bfloat16, "w"); y float32 or bfloat16. Products are
summed in float32; the shrink x @ A is rounded to w (as peft's module does in bf16), the
delta is added to y in float32 and rounded once to y's dtype. y' reuses y's buffer where XLA
can alias it.

Why: in XLA:CPU every projection paid a lax.switch (about 0.15 ms each even when no token
has an adapter: 31 ms of a 64-row decode step's 210 projections, benchmarks/lora_project.py),
and around the rank-16 dots a gather of its slot's tables and a one-hot mask. On SmolLM2
(benchmarks/lora.py) one adapter went from 0.79x base throughput to 0.97x, 4 mixed from
0.77x to 0.88x, 16 swapping through 4 slots from 0.41x to 0.78x (its scheduling-only
ceiling: 0.81x).
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import native_library
from jaxllm.kernels.native_library import Availability
from jaxllm.models.dtype import cpu_flags

TARGET = "jaxllm_cpu_lora"
_LIB_STEM = "_cpu_lora"
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@functools.cache
def _library() -> Availability:
    lib = native_library.open_library(_LIB_STEM, native_library.find(_LIB_STEM),
                                      "JaxllmCpuLora")
    if lib:
        lib.lib.JaxllmCpuLoraIsa.restype = ctypes.c_int
    return lib


@functools.cache
def availability(dtype) -> Availability:
    """For tables of `dtype` (float32 or bfloat16). Tests clear this cache (and
    `_library`'s) to simulate a missing library."""
    dtype = jnp.dtype(dtype)
    if dtype not in _FLOATS:
        return Availability(None, f"it multiplies float32 or bfloat16 tables, not {dtype}")
    if "avx512f" not in cpu_flags():
        return Availability(None, "this CPU has no AVX512F")
    lib = _library()
    if lib and not lib.lib.JaxllmCpuLoraIsa() & 1:
        return Availability(None, "the library was built on a CPU without AVX512F (it is "
                                  "compiled with -march=native: rebuild it here)")
    if lib and lib.lib.JaxllmCpuLoraIsa() & 2 and "avx512_bf16" not in cpu_flags():
        return Availability(None, "the library was built with AVX512-BF16, which this CPU "
                                  "lacks (it is compiled with -march=native: rebuild it here)")
    return lib


@functools.cache
def warn_unavailable(dtype) -> None:
    """Says once why LoRA on cpu runs in XLA instead of the kernel."""
    warnings.warn(f"the CPU LoRA kernel is unavailable ({availability(dtype).reason}); LoRA "
                  f"runs in XLA (a switch and two skinny dots per projection: one adapter on "
                  f"SmolLM2 ran at 0.79x base throughput so, 0.97x with the kernel)",
                  RuntimeWarning, stacklevel=3)


@functools.cache
def _registered() -> None:
    lib = _library()
    if not lib:
        raise RuntimeError(f"the CPU LoRA library is unavailable: {lib.reason}")
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.lib.JaxllmCpuLora),
                                platform="cpu")


def _check(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer: int, num_adapters: int) -> None:
    if x_TK.ndim != 2 or y_TN.ndim != 2 or A_SLKR.ndim != 4 or B_SLRN.ndim != 4 \
            or m_T.ndim != 1:
        raise ValueError(f"x must be [T, K], y [T, N], A [S, L, K, R], B [S, L, R, N] and "
                         f"m [T], got shapes {x_TK.shape}, {y_TN.shape}, {A_SLKR.shape}, "
                         f"{B_SLRN.shape}, {m_T.shape}")
    T, K = x_TK.shape
    S, L, _, R = A_SLKR.shape
    if y_TN.shape[0] != T or m_T.shape[0] != T or A_SLKR.shape[2] != K \
            or B_SLRN.shape != (S, L, R, y_TN.shape[1]):
        raise ValueError(f"x {x_TK.shape}, y {y_TN.shape}, A {A_SLKR.shape}, B "
                         f"{B_SLRN.shape} and m {m_T.shape} disagree on T, K, N, S, L or R")
    if not 0 <= layer < L:
        raise ValueError(f"layer must be in [0, {L}), got {layer}")
    if not 0 <= num_adapters <= S:
        raise ValueError(f"num_adapters must be in [0, {S}], got {num_adapters}")
    w = jnp.dtype(x_TK.dtype)
    if w not in _FLOATS or jnp.dtype(A_SLKR.dtype) != w or jnp.dtype(B_SLRN.dtype) != w:
        raise ValueError(f"x, A and B must be all float32 or all bfloat16, got {x_TK.dtype}, "
                         f"{A_SLKR.dtype}, {B_SLRN.dtype}")
    if jnp.dtype(y_TN.dtype) not in _FLOATS:
        raise ValueError(f"y must be float32 or bfloat16, got {y_TN.dtype}")
    if jnp.dtype(m_T.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"m must be int32, got {m_T.dtype}")


def lora_apply(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer: int, num_adapters: int):
    """y with each token's adapter delta added (the module docstring's contract)."""
    _check(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer, num_adapters)
    _registered()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(y_TN.shape, y_TN.dtype),
                            vmap_method="sequential", input_output_aliases={1: 0})
    return call(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer=np.int64(layer),
                num_adapters=np.int64(num_adapters))


def lora_apply_reference(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer: int, num_adapters: int):
    """`lora_apply` in plain XLA: every token's own slot's tables gathered ([T, K, R] and
    [T, R, N]: tests only)."""
    _check(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer, num_adapters)
    has_T = (m_T >= 0) & (m_T < num_adapters)
    s_T = jnp.where(has_T, m_T, 0)
    A_TKR, B_TRN = A_SLKR[s_T, layer], B_SLRN[s_T, layer]
    xa_TR = jnp.einsum("tk,tkr->tr", x_TK, A_TKR, preferred_element_type=jnp.float32)
    d_TN = jnp.einsum("tr,trn->tn", xa_TR.astype(A_SLKR.dtype), B_TRN,
                      preferred_element_type=jnp.float32)
    out_TN = (y_TN.astype(jnp.float32) + d_TN).astype(y_TN.dtype)
    return jnp.where(has_T[:, None], out_TN, y_TN)
