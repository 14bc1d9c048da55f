"""Grouped GEMM on CPU as a C++ XLA FFI call: rows sorted by group, each group multiplied
by its own weight, the weights stacked [E, K, N] and read in place (a mixture of experts'
expert weights, models/moe.py).

Owns: registering the handler `JaxllmCpuGroupedGemm` (in the cpu_gemm library, so its
availability is cpu_gemm.availability), `grouped_gemm`, a validated wrapper, and
`grouped_gemm_reference`, the same product in plain XLA with the same signature (every group
on every row, then masked: tests only). Must never: be used where cpu_gemm could not (the
"cpu" linear method chooses it, kernels/linear_methods.py); copy or convert the stacked
weights (that is the point: XLA:CPU converts a whole bf16 expert stack to f32 on every step
when a dot's weight is a slice chosen at run time).

    x rows sorted by group:   | group 0 | group 1 (empty) | group 2 | ... | no group |
    group_end [E] (int32):      end_0     end_0             end_2           end_{E-1}

Row r is in group e when group_end[e-1] <= r < group_end[e] (group_end[-1] = 0); rows from
group_end[E-1] on are in no group and come out zero. The kernel clamps group_end to be
nondecreasing within [0, M], so no value reads or writes outside the arrays. Products are
accumulated in float32 (the dense GEMM's micro-kernels) and rounded once to out_dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.kernels import cpu_gemm

TARGET = "jaxllm_cpu_grouped_gemm"
HANDLER = "JaxllmCpuGroupedGemm"


@functools.cache
def _registered() -> None:
    lib = cpu_gemm._library()
    if not lib:
        raise RuntimeError(f"the CPU GEMM library is unavailable: {lib.reason}")
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib.lib, HANDLER)),
                                platform="cpu")


def _check(x_MK, w_EKN, group_end_E, out_dtype) -> None:
    if x_MK.ndim != 2 or w_EKN.ndim != 3 or group_end_E.ndim != 1:
        raise ValueError(f"x must be [M, K], w [E, K, N] and group_end [E], got shapes "
                         f"{x_MK.shape}, {w_EKN.shape}, {group_end_E.shape}")
    if w_EKN.shape[1] != x_MK.shape[1] or group_end_E.shape[0] != w_EKN.shape[0]:
        raise ValueError(f"x {x_MK.shape}, w {w_EKN.shape} and group_end "
                         f"{group_end_E.shape} disagree on K or E")
    if jnp.dtype(x_MK.dtype) != jnp.dtype(w_EKN.dtype):
        raise ValueError(f"x is {x_MK.dtype} but w is {w_EKN.dtype}")
    floats = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    if jnp.dtype(x_MK.dtype) not in floats:
        raise ValueError(f"the grouped GEMM multiplies float32 or bfloat16, not {x_MK.dtype}")
    if jnp.dtype(out_dtype) not in floats:
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if jnp.dtype(group_end_E.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"group_end must be int32, got {group_end_E.dtype}")


def grouped_gemm(x_MK, w_EKN, group_end_E, out_dtype=jnp.float32):
    """y [M, N] in out_dtype: y[r] = x[r] @ w[e] for each row r of group e (see the module
    docstring), zero for rows in no group; x and w of one dtype (float32 or bfloat16)."""
    _check(x_MK, w_EKN, group_end_E, out_dtype)
    _registered()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(
        (x_MK.shape[0], w_EKN.shape[2]), out_dtype), vmap_method="sequential")
    return call(x_MK, w_EKN, group_end_E)


def grouped_gemm_reference(x_MK, w_EKN, group_end_E, out_dtype=jnp.float32):
    """`grouped_gemm` in plain XLA (every group's product on every row, then the row's own
    picked: E times the work; tests only)."""
    _check(x_MK, w_EKN, group_end_E, out_dtype)
    M, E = x_MK.shape[0], w_EKN.shape[0]
    end_E = jax.lax.cummax(jnp.clip(group_end_E, 0, M))
    group_M = jnp.searchsorted(end_E, jnp.arange(M), side="right")  # E: in no group
    y_MEN = jnp.einsum("mk,ekn->men", x_MK, w_EKN, preferred_element_type=jnp.float32)
    y_MN = jnp.take_along_axis(y_MEN, jnp.minimum(group_M, E - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where((group_M < E)[:, None], y_MN, 0.0).astype(out_dtype)
