"""Linear methods as objects: how a dense weight is stored after loading, and multiplied.

Owns: the two methods ("xla": XLA's dot on the weights as loaded; "cpu": the C++ GEMM of
kernels/cpu_gemm.py on weights packed once after loading), the default's choice by asking
them in order of preference, the one line that says which one runs, and the one warning
when the preferred one cannot. vLLM's names: a layer's weights go through
`process_weights_after_loading` once (as vLLM's CPU backend packs them for oneDNN), then the
method `apply`s them.
Must never: pick a method silently in place of the preferred one; accept one that cannot run
here (a ValueError names it and why); run "cpu" under tensor parallelism (an FFI call is
opaque to the SPMD partitioner, which would gather every weight onto each device).

Every method multiplies in the weights' dtype and accumulates in float32; a layer's output
is rounded to its dtype once (after the bias, added in float32), as torch's bf16 linear.

What a method sees (models/parallel.py calls it with no mesh):

    apply(layer, x [T, in])                   -> [T, out] in layer.dtype
    logits(h [S, D], w, spec)                 -> float32 [S, >= V] (the caller slices V)
    embed(table, ids [T], features=D)         -> [T, D]; `table` as loaded, or as
                                                 process_embedding left it when tied
    expert_ffn(x [T, D], weights [T, k], ids [T, k], gate_up [E, D, 2, F], down [E, F, D])
                                              -> float32 [T, D], a mixture of experts'
                                                 chosen FFNs (models/moe.py), the expert
                                                 weights as loaded (never packed)
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)


class LinearMethod:
    """One way to store and multiply dense weights. Subclasses set `name` and the methods."""

    name: str = ""
    description: str = ""

    def unavailable_reason(self, platform: str, dtype, tensor_parallel_size: int) -> str | None:
        """Why this method cannot run for `dtype` weights on `platform` (a jax platform name)
        at this tensor-parallel size, or None."""
        return None

    def process_weights_after_loading(self, w_KN):
        """A linear layer's kernel [in, out], as loaded -> the form `apply` multiplies."""
        return w_KN

    def process_embedding(self, table_VD):
        """A tied embedding [V, D] (lookup table and LM head) -> the form `embed` and
        `logits` read."""
        return table_VD

    def weight_format(self, dtype) -> str:
        """Names the form process_weights_after_loading leaves `dtype` weights in: a saved
        state (models/saved_state.py) is restored only where this matches."""
        return "as loaded"

    def apply(self, layer, x_TK):
        return layer(x_TK)

    def logits(self, h_SD, w, spec: str):
        return jnp.einsum(spec, h_SD, w, preferred_element_type=jnp.float32)

    def embed(self, table, ids_T, features: int):
        return jnp.take(table, ids_T, axis=0)

    def expert_ffn(self, x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD):
        from jaxllm.models.moe import expert_ffn
        return expert_ffn(x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD)

    def __repr__(self) -> str:
        return f"LinearMethod({self.name!r})"


class XlaLinearMethod(LinearMethod):
    """XLA's dot on the weights as loaded (on CPU XLA hands it to YNNPACK, which packs the
    weight for its kernel again on every call)."""

    name, description = "xla", "XLA's dot (YNNPACK on CPU), weights as loaded"


class CpuGemmLinearMethod(LinearMethod):
    """The C++ GEMM through XLA FFI (kernels/cpu_gemm.py) on weights packed after loading."""

    name, description = "cpu", ("the C++ GEMM (kernels/cpu_gemm.py) on weights packed at load, "
                                 "and its grouped GEMM on expert weights in place")

    def unavailable_reason(self, platform: str, dtype, tensor_parallel_size: int) -> str | None:
        from jaxllm.kernels import cpu_gemm
        if platform != "cpu":
            return f"it runs on cpu, not {platform}"
        if tensor_parallel_size > 1:
            return ("tensor parallelism splits the weights with XLA's SPMD partitioner, which "
                    "cannot see into an FFI call")
        status = cpu_gemm.availability(dtype)
        return None if status else status.reason

    def process_weights_after_loading(self, w_KN):
        from jaxllm.kernels import cpu_gemm
        return _jitted(cpu_gemm.pack)(w_KN)

    def process_embedding(self, table_VD):
        from jaxllm.kernels import cpu_gemm
        return _jitted(lambda t: cpu_gemm.pack(t.T))(table_VD)

    def weight_format(self, dtype) -> str:
        from jaxllm.kernels import cpu_gemm
        return f"cpu_gemm panels of {cpu_gemm.PANEL} columns, v{cpu_gemm.PACK_VERSION}"

    def apply(self, layer, x_TK):
        from jaxllm.kernels import cpu_gemm
        w = layer.kernel[...]
        x_TK = x_TK.astype(w.dtype)
        if layer.bias is None:
            return cpu_gemm.gemm(x_TK, w, layer.out_features, layer.dtype)
        y = cpu_gemm.gemm(x_TK, w, layer.out_features, jnp.float32)
        return (y + layer.bias[...].astype(jnp.float32)).astype(layer.dtype)

    def logits(self, h_SD, w, spec: str):
        from jaxllm.kernels import cpu_gemm
        # Packed, an LM head is W [D, V] whichever way it was loaded (`spec` told the loaded
        # form apart); its columns run to the last panel's end.
        return cpu_gemm.gemm(h_SD.astype(w.dtype), w, w.shape[0] * cpu_gemm.PANEL,
                             jnp.float32)

    def embed(self, table, ids_T, features: int):
        from jaxllm.kernels import cpu_gemm
        if table.ndim == 2:  # untied: the table stays as loaded, [V, D]
            return super().embed(table, ids_T, features)
        return cpu_gemm.columns(table, ids_T, features)

    def expert_ffn(self, x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD):
        # The C++ grouped GEMM reads each chosen expert's weights in place; XLA's loop
        # converted the whole bf16 stack to f32 every step (models/moe.py).
        from jaxllm.kernels.cpu_grouped_gemm import grouped_gemm
        from jaxllm.models.moe import expert_ffn_grouped
        return expert_ffn_grouped(x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD,
                                  grouped_gemm)


@functools.cache
def _jitted(fn):
    return jax.jit(fn)


LINEAR_METHODS: dict[str, LinearMethod] = {
    m.name: m for m in (XlaLinearMethod(), CpuGemmLinearMethod())}
# Tried in order on each platform; the first that can run is the default.
PREFERRED = {"cpu": ("cpu", "xla")}
# What falling back costs, measured (benchmarks/cpu_gemm.py), for the warning.
_FALLBACK_COST = {
    "cpu": "XLA's bf16 GEMMs took 1.1x-3.5x the C++ kernel's time at decode and prefill "
           "shapes in benchmarks/cpu_gemm.py (2-core AVX512-BF16 CPU, SmolLM2 shapes), and "
           "a tiny Mixtral's bf16 decode step 2.3x-2.7x with XLA's expert loop "
           "(benchmarks/moe_step.py)",
}


def get_linear_method(name: str) -> LinearMethod:
    if name not in LINEAR_METHODS:
        raise ValueError(f"linear_backend must be one of {tuple(LINEAR_METHODS)}, got {name!r}")
    return LINEAR_METHODS[name]


def choose_linear_method(name: str | None, dtype, *, tensor_parallel_size: int = 1,
                         platform: str | None = None) -> tuple[LinearMethod, str | None]:
    """(the method, why the preferred one cannot run or None), saying nothing: the method
    named (ValueError if it cannot run here), or the platform's preferred one that can.
    platform: a jax platform (default: jax.default_backend())."""
    platform = platform or jax.default_backend()
    dtype = jnp.dtype(dtype)
    if name is not None:
        method = get_linear_method(name)
        reason = method.unavailable_reason(platform, dtype, tensor_parallel_size)
        if reason is not None:
            raise ValueError(f'linear_backend="{name}" cannot run {dtype} weights on platform '
                             f'"{platform}": {reason}')
        return method, None
    # Under tensor parallelism XLA's partitioner lays the weights out: "xla" is the only
    # choice, not a fallback.
    preferred = PREFERRED.get(platform, ("xla",)) if tensor_parallel_size == 1 else ("xla",)
    for candidate in preferred:
        method = LINEAR_METHODS[candidate]
        if method.unavailable_reason(platform, dtype, tensor_parallel_size) is None:
            first = LINEAR_METHODS[preferred[0]]
            return method, (None if candidate == preferred[0] else
                            first.unavailable_reason(platform, dtype, tensor_parallel_size))
    raise ValueError(f"no linear method can run on platform {platform!r}")


def select_linear_method(name: str | None, dtype, *, tensor_parallel_size: int = 1,
                         platform: str | None = None) -> LinearMethod:
    """choose_linear_method's method, for the engine: falling back from the preferred one
    warns once, with the reason and the cost; the choice is logged once."""
    method, fallback_reason = choose_linear_method(
        name, dtype, tensor_parallel_size=tensor_parallel_size, platform=platform)
    dtype = jnp.dtype(dtype)
    if fallback_reason is not None:
        preferred = PREFERRED[platform or jax.default_backend()][0]
        _warn_fallback(preferred, method.name, dtype.name, fallback_reason)
    _log_choice(method.name, dtype.name,
                "as configured" if name is not None else "the default here")
    return method


@functools.cache
def _log_choice(name: str, dtype: str, why: str) -> None:
    logger.info('linear layers: "%s" (%s) for %s weights, %s', name,
                LINEAR_METHODS[name].description, dtype, why)


@functools.cache
def _warn_fallback(preferred: str, chosen: str, dtype: str, reason: str) -> None:
    warnings.warn(f'linear backend "{preferred}" is unavailable for {dtype} weights ({reason}); '
                  f'using "{chosen}" instead, which is slower: {_FALLBACK_COST[preferred]}',
                  RuntimeWarning, stacklevel=3)
