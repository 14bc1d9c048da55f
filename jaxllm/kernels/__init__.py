"""Attention backends behind one signature (see kernels/reference.py for it).

"cpu": kernels/cpu_attention.py, a C++ kernel called through XLA FFI, the CPU default when its
library is built and there is no tensor parallelism. "xla": kernels/xla_attention.py, pure XLA
with work in proportion to each sequence's real context, the CPU fallback. "pallas": the
Pallas Triton kernel, the GPU default. "pallas_interpret": the same kernel run by the Pallas
interpreter (CPU testing). kernels/reference.py is the simple reference all of them are tested
against, not a backend.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("xla", "cpu", "pallas", "pallas_interpret")


def get_attention_fn(backend: str):
    if backend == "xla":
        from jaxllm.kernels.xla_attention import ragged_paged_attention
        return ragged_paged_attention
    if backend == "cpu":
        from jaxllm.kernels import cpu_attention
        if not cpu_attention.availability():
            raise RuntimeError(f'attention backend "cpu" is unavailable: '
                               f'{cpu_attention.availability().reason}')
        return cpu_attention.ragged_paged_attention
    if backend in ("pallas", "pallas_interpret"):
        from jaxllm.kernels.paged_attention import ragged_paged_attention
        return functools.partial(ragged_paged_attention, interpret=backend == "pallas_interpret")
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")


def default_attention_backend(tensor_parallel_size: int = 1) -> str:
    """"pallas" on GPU; on CPU "cpu" when its library loads and there is no tensor parallelism
    (an FFI call is opaque to the SPMD partitioner), else "xla"."""
    import jax
    platform = jax.default_backend()
    if platform == "gpu":
        return "pallas"
    if platform == "cpu" and tensor_parallel_size == 1:
        from jaxllm.kernels import cpu_attention
        status = cpu_attention.availability()
        if status:
            return "cpu"
        logger.info('attention backend "cpu" unavailable (%s); using "xla"', status.reason)
    return "xla"
