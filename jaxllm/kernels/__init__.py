"""Attention backends behind one signature (see kernels/reference.py for it).

"xla": kernels/xla_attention.py, pure XLA with work in proportion to each sequence's real
context, the CPU default. "pallas": the Pallas Triton kernel, the GPU default.
"pallas_interpret": the same kernel run by the Pallas interpreter (CPU testing).
kernels/reference.py is the simple reference all of them are tested against, not a backend.
"""

from __future__ import annotations

import functools

ATTENTION_BACKENDS = ("xla", "pallas", "pallas_interpret")


def get_attention_fn(backend: str):
    if backend == "xla":
        from jaxllm.kernels.xla_attention import ragged_paged_attention
        return ragged_paged_attention
    if backend in ("pallas", "pallas_interpret"):
        from jaxllm.kernels.paged_attention import ragged_paged_attention
        return functools.partial(ragged_paged_attention, interpret=backend == "pallas_interpret")
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")


def default_attention_backend() -> str:
    import jax
    return "pallas" if jax.default_backend() == "gpu" else "xla"
