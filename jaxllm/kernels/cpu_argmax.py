"""Greedy top-1 on CPU: a C++ XLA FFI call that reads each row of logits once.

Owns: its library (opened through native_library.py), built from kernels/csrc/cpu_argmax.cc
(setup.py), registering its handler with XLA once, `argmax_first` (float32 [S, V] -> int32 [S])
and `argmax_first_reference`, the same in plain XLA with the same signature: top_k's index,
whose order the kernel reproduces exactly (IEEE total order, so NaN and signed zeros too; the
first index among equals). `available()` says whether the kernel can run here, and why not. Must
never: be chosen on a platform other than cpu (`argmax_first_here` asks
jax.lax.platform_dependent), or change which token greedy decoding picks.

Why: XLA:CPU's top_k(x, 1) over [64, 49152] float32 took about 4 ms of a 100 ms decode step
(its argmax, a (value, index) reduce, 13 ms); one vectorised read of the 12.6 MB runs at
memory speed.
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import jax
import jax.numpy as jnp

from jaxllm.kernels import native_library
from jaxllm.kernels.native_library import Availability

TARGET = "jaxllm_cpu_argmax_first"
_LIB_STEM = "_cpu_argmax"


@functools.cache
def available() -> Availability:
    lib = native_library.open_library(_LIB_STEM, native_library.find(_LIB_STEM),
                                      "JaxllmCpuArgmaxFirst")
    if lib:
        lib.lib.JaxllmCpuArgmaxScalar.restype = ctypes.c_int32
        lib.lib.JaxllmCpuArgmaxScalar.argtypes = [ctypes.c_void_p, ctypes.c_long]
    return lib


@functools.cache
def warn_unavailable() -> None:
    """Says once why greedy top-1 on cpu runs top_k instead of the kernel."""
    warnings.warn(f"the CPU argmax kernel is unavailable ({available().reason}); greedy "
                  f"top-1 runs XLA's top_k, about 4 ms more per 64-row decode step",
                  stacklevel=3)


@functools.cache
def _registered() -> None:
    lib = available()
    if not lib:
        raise RuntimeError(f"the CPU argmax library is unavailable: {lib.reason}")
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.lib.JaxllmCpuArgmaxFirst),
                                platform="cpu")


def _check(x_SV) -> None:
    if x_SV.ndim != 2 or x_SV.shape[1] == 0:
        raise ValueError(f"x must be [S, V] with V >= 1, got shape {x_SV.shape}")
    if jnp.dtype(x_SV.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"x must be float32, got {x_SV.dtype}")


def argmax_first(x_SV):
    """float32 [S, V] -> int32 [S]: each row's first index of its largest value, in top_k's
    order (IEEE total order: -NaN < -inf < -0 < +0 < +inf < +NaN)."""
    _check(x_SV)
    _registered()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x_SV.shape[0],), jnp.int32),
                            vmap_method="sequential")
    return call(x_SV)


def argmax_first_reference(x_SV):
    """`argmax_first` in plain XLA: the same signature and contract."""
    _check(x_SV)
    return jax.lax.top_k(x_SV, 1)[1][:, 0].astype(jnp.int32)


def argmax_first_here(x_SV):
    """The sampler's greedy top-1 (runner/sampler.py): jnp.argmax over the last axis as
    top_k's index. XLA:CPU runs argmax's (value, index) reduce unvectorized (7 ms at
    [64, 49152]) and top_k(x, 1) in about 4 ms; on the cpu platform the kernel reads each
    row once (about 0.6 ms). Elsewhere, or without the library (said once), top_k."""
    x_SV = x_SV.astype(jnp.float32)
    if not available():
        if jax.default_backend() == "cpu":
            warn_unavailable()
        return argmax_first_reference(x_SV)
    return jax.lax.platform_dependent(x_SV, cpu=argmax_first, default=argmax_first_reference)
