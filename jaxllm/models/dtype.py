"""What `dtype="auto"` means on this machine: the one place that picks the compute dtype.

Owns the rule and reading what the CPU is. Never loads weights or touches a device beyond
asking jax which platform it runs on; the timing itself is models/auto_dtype.py's.

  accelerator   bfloat16 (what vLLM serves Llama checkpoints in)
  CPU           measured: bfloat16 where the model's decode GEMMs run more than 3% faster
                in it than in float32, else float32 (models/auto_dtype.py); the verdict is
                cached per CPU model, jax version and model shapes

An explicit dtype always wins. Norms, RoPE, softmax and logits stay float32 whatever this
picks (models/layers.py).
"""

from __future__ import annotations

import functools
import logging
import platform as _platform
from typing import Callable

import jax.numpy as jnp

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _cpuinfo_field(name: str, path: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo does not exist)."""
    return frozenset((_cpuinfo_field("flags", path) or "").split())


@functools.cache
def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name ("AMD EPYC 9654 96-Core Processor"), else what Python knows."""
    return (_cpuinfo_field("model name", path) or _platform.processor()
            or _platform.machine() or "unknown CPU")


def resolve_dtype(dtype: str, platform: str, measure: Callable | None = None):
    """The jnp dtype for a `dtype` argument ("auto" or a DTYPES name) on `platform`.
    measure(): the AutoDtypeVerdict for "auto" on a CPU (the engine passes one for its
    model's shapes and cache); None measures the default model's shapes, uncached."""
    if dtype != "auto":
        return DTYPES[dtype]
    if platform != "cpu":
        return jnp.bfloat16
    if measure is None:
        from jaxllm.models.auto_dtype import auto_dtype_verdict

        measure = auto_dtype_verdict
    return DTYPES[measure().dtype]
