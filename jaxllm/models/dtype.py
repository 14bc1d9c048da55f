"""What `dtype="auto"` means on this machine: the one place that picks the compute dtype.

Owns the rule and the CPU feature check behind it. Never loads weights or touches a device
beyond asking jax which platform it runs on.

  accelerator                               bfloat16 (what vLLM serves Llama checkpoints in)
  CPU with bf16 matrix units (AMX or        bfloat16: XLA's bf16 GEMMs run 1.7-2x the f32 ones
  AVX512-BF16)                              from 16 rows up, and the engine never runs a
                                            1-row step (the smallest token bucket is 2)
  any other CPU                             float32

Norms, RoPE, softmax and logits stay float32 whatever this picks (models/layers.py).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
BF16_MATRIX_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo does not exist)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(dtype: str, platform: str, flags: frozenset[str] | None = None):
    """The jnp dtype for a `dtype` argument ("auto" or a DTYPES name) on `platform`."""
    if dtype != "auto":
        return DTYPES[dtype]
    if platform != "cpu":
        return jnp.bfloat16
    flags = cpu_flags() if flags is None else flags
    return jnp.bfloat16 if any(f in flags for f in BF16_MATRIX_FLAGS) else jnp.float32
