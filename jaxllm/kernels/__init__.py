"""Attention kernels over the paged KV cache, dense GEMMs, and the objects that choose among
them.

"cpu": kernels/cpu_attention.py, a C++ kernel called through XLA FFI, the CPU default when its
library is built. "xla": kernels/xla_attention.py, pure XLA with work in proportion to each
sequence's real context. "pallas": the Pallas Triton kernel, the GPU default.
"pallas_interpret": the same kernel run by the Pallas interpreter (CPU testing).
kernels/reference.py is the simple reference all of them are tested against, not a backend.
The backends themselves (storage, availability, per-shard specs, the default's choice) are
objects in kernels/backends.py, the linear methods in kernels/linear_methods.py; this module
only names them, without importing jax, so that configuration can be checked before jax
starts.
"""

from __future__ import annotations

ATTENTION_BACKENDS = ("xla", "cpu", "pallas", "pallas_interpret")
# How dense weights are stored and multiplied (kernels/linear_methods.py): "xla", or "cpu",
# the C++ GEMM of kernels/cpu_gemm.py on weights packed once after loading.
LINEAR_BACKENDS = ("xla", "cpu")
