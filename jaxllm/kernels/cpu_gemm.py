"""Dense GEMM on CPU as a C++ XLA FFI call, against weights packed once at load.

Owns: its library (opened through native_library.py), built from kernels/csrc/cpu_gemm.cc
(setup.py), registering its handler with XLA once, the packed weight layout (`pack`, `unpack`),
`gemm`, a validated wrapper, and `gemm_reference`, the same product in plain XLA with the same
signature. `availability(dtype)` says whether the kernel can run here for that dtype, and why
not. Must never: be used under tensor parallelism (an FFI call is opaque to the SPMD
partitioner); run a bf16 product on a CPU without AVX512-BF16 (the library is compiled for the
machine that built it; a CPU without the instructions would fault).

Why: XLA:CPU (jaxlib 0.10) sends each dot to YNNPACK, whose bf16 kernel is vdpbf16ps too, but
which packs the weight into its kernel's layout again on every call, every step (a full pass
over the weight, 18% of a decode GEMM's time in a profile), plus the per-call set-up.
benchmarks/cpu_gemm.py measures the two side by side.

Packed layout. W [K, N] becomes P = ceil(N / 32) panels of 32 columns, each contiguous:

    bf16: [P, ceil(K/2), 64]   panel p, row k2 = the 32 columns' pairs (W[2k2, c], W[2k2+1, c])
                               for c = 32p .. 32p+31, interleaved (vdpbf16ps' operand order)
    f32:  [P, K, 32]           panel p, row k = W[k, 32p .. 32p+31]

zero-padded past K and N (the padding is multiplied, never stored: y keeps N columns). The
kernel accumulates in f32 whatever the inputs, and rounds to bf16 once when y is bf16.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels import native_library
from jaxllm.kernels.native_library import Availability
from jaxllm.models.dtype import cpu_flags

TARGET = "jaxllm_cpu_gemm"
PANEL = 32
PACK_VERSION = 1  # bump when `pack` changes: saved states of packed weights key on it
_LIB_STEM = "_cpu_gemm"
_ISA_AVX512F, _ISA_AVX512_BF16 = 1, 2


def library_path() -> str | None:
    return native_library.find(_LIB_STEM)


@functools.cache
def _library() -> Availability:
    lib = native_library.open_library(_LIB_STEM, library_path(), "JaxllmCpuGemm")
    if not lib:
        return lib
    # The grouped GEMM (kernels/cpu_grouped_gemm.py) is in the same library: one built from
    # an older cpu_gemm.cc lacks it, and the "cpu" linear method needs both.
    if not hasattr(lib.lib, "JaxllmCpuGroupedGemm"):
        return Availability(None, f"{library_path()} has no JaxllmCpuGroupedGemm (built from "
                                  f"an older cpu_gemm.cc: rebuild it, pip install -e .)")
    lib.lib.JaxllmCpuGemmIsa.restype = ctypes.c_int
    return lib


@functools.cache
def availability(dtype) -> Availability:
    """For weights and activations of `dtype` (float32 or bfloat16). Tests clear this cache
    (and `_library`'s) to simulate a missing library."""
    dtype = jnp.dtype(dtype)
    need = {jnp.dtype(jnp.float32): ("avx512f", _ISA_AVX512F),
            jnp.dtype(jnp.bfloat16): ("avx512_bf16", _ISA_AVX512_BF16)}.get(dtype)
    if need is None:
        return Availability(None, f"it multiplies float32 or bfloat16, not {dtype}")
    flag, bit = need
    if flag not in cpu_flags():
        return Availability(None, f"this CPU has no {flag.upper().replace('_', '-')}")
    lib = _library()
    if not lib:
        return lib
    if not lib.lib.JaxllmCpuGemmIsa() & bit:
        return Availability(None, f"the library was built on a CPU without "
                                  f"{flag.upper().replace('_', '-')} (it is compiled with "
                                  f"-march=native: rebuild it here)")
    return lib


@functools.cache
def _registered() -> None:
    lib = _library()
    if not lib:
        raise RuntimeError(f"the CPU GEMM library is unavailable: {lib.reason}")
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.lib.JaxllmCpuGemm), platform="cpu")


def num_threads() -> int:
    """Threads the library's pool runs a GEMM on, the caller's included."""
    _registered()
    fn = _library().lib.JaxllmCpuGemmNumThreads
    fn.restype = ctypes.c_int
    return int(fn())


def packed_shape(k: int, n: int, dtype) -> tuple[int, int, int]:
    panels = -(-n // PANEL)
    if jnp.dtype(dtype) == jnp.bfloat16:
        return (panels, -(-k // 2), 2 * PANEL)
    return (panels, k, PANEL)


def pack(w_KN):
    """W [K, N] (float32 or bfloat16) -> its packed panels (see the module docstring)."""
    K, N = w_KN.shape
    P = -(-N // PANEL)
    if jnp.dtype(w_KN.dtype) == jnp.bfloat16:
        K2 = -(-K // 2)
        w = jnp.pad(w_KN, ((0, 2 * K2 - K), (0, P * PANEL - N)))
        # [K2, 2, P, 32] -> [P, K2, 32, 2]: each column's pair of rows side by side.
        return w.reshape(K2, 2, P, PANEL).transpose(2, 0, 3, 1).reshape(P, K2, 2 * PANEL)
    w = jnp.pad(w_KN, ((0, 0), (0, P * PANEL - N)))
    return w.reshape(K, P, PANEL).transpose(1, 0, 2)


def unpack(packed, k: int, n: int):
    """The inverse of `pack`: packed panels -> W [k, n]."""
    P = packed.shape[0]
    if jnp.dtype(packed.dtype) == jnp.bfloat16:
        K2 = packed.shape[1]
        w = packed.reshape(P, K2, PANEL, 2).transpose(1, 3, 0, 2).reshape(2 * K2, P * PANEL)
    else:
        w = packed.transpose(1, 0, 2).reshape(packed.shape[1], P * PANEL)
    return w[:k, :n]


def columns(packed, ids, k: int):
    """Columns `ids` [T] of the packed W [k, N], as rows [T, k]: the lookup of an embedding
    table [N, k] stored packed as W = table.T (a tied LM head)."""
    panel, col = ids // PANEL, ids % PANEL
    if jnp.dtype(packed.dtype) == jnp.bfloat16:
        P, K2 = packed.shape[:2]
        # [P, K2, 32, 2][panel, :, col, :] -> [T, K2, 2]: each id's pairs, in k order.
        rows = packed.reshape(P, K2, PANEL, 2)[panel, :, col, :].reshape(ids.shape[0], 2 * K2)
    else:
        rows = packed[panel, :, col]
    return rows[:, :k]


def _check(x, packed, n: int, out_dtype) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) != jnp.dtype(packed.dtype):
        raise ValueError(f"x is {x.dtype} but the packed weight is {packed.dtype}")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"the CPU GEMM multiplies float32 or bfloat16, not {x.dtype}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    want = packed_shape(x.shape[1], n, x.dtype)
    if tuple(packed.shape) != want:
        raise ValueError(f"packed weight of shape {tuple(packed.shape)} does not fit K = "
                         f"{x.shape[1]}, N = {n} (expected {want})")


def gemm(x_MK, packed, n: int, out_dtype=jnp.float32):
    """x [M, K] @ W [K, n] -> [M, n] in out_dtype, W given `pack`ed; x and W of one dtype
    (float32 or bfloat16), products accumulated in float32."""
    _check(x_MK, packed, n, out_dtype)
    _registered()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x_MK.shape[0], n), out_dtype),
                            vmap_method="sequential")
    return call(x_MK, packed)


def gemm_reference(x_MK, packed, n: int, out_dtype=jnp.float32):
    """`gemm` in plain XLA: the same signature and contract."""
    _check(x_MK, packed, n, out_dtype)
    w = unpack(packed, x_MK.shape[1], n)
    return jnp.dot(x_MK, w, preferred_element_type=jnp.float32).astype(out_dtype)
