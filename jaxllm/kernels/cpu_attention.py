"""Ragged paged attention as a C++ XLA FFI call on CPU (backend "cpu").

Owns: its library (opened through native_library.py), built from kernels/csrc (setup.py),
registering its handler with XLA once, and `ragged_paged_attention`, a validated wrapper with
the signature and semantics of kernels/reference.py. `availability()` says whether the library
loaded, and why not. Must never: be chosen when the library is missing (kernels/__init__.py
falls back to "xla"); be used under tensor parallelism (an FFI custom call is opaque to the SPMD
partitioner, which would gather every sharded cache onto each device); read a causally invisible
cache slot.

Work split (csrc/cpu_attention.cc). Each sequence's query rows are cut into tiles of up to
16 rows; an item is one tile against a range of key blocks (16 key positions each), for all
kv heads, so each page's K and V rows are read contiguously, once per tile:

    seq 0: decode, 1 row, 1000 keys    seq 1: 40 new rows after 200 cached
    [row 0 | blocks 0..62]             [rows  0..15 | blocks 0..13]  keys [0, 216)
                                       [rows 16..31 | blocks 0..14]  keys [0, 232)
                                       [rows 32..39 | blocks 0..14]  keys [0, 240)

Items go largest first to a persistent thread pool (one thread per CPU, or
JAXLLM_CPU_ATTENTION_THREADS, the calling thread included), each thread claiming them from one
atomic counter. While more than 2 x threads items are left, a thread claims its next item
before running the current one, and in the current one's last key blocks prefetches the next
one's first: a run of short decode rows keeps its loads in flight across rows (on a 2-core
EPYC under load 8-11, 64 rows x 200 keys of bf16: 5-13% less time per call than a cold start
per row, A/B interleaved).

A row's output has the same bits whatever the other rows of the call (a verify step's 5 rows
of a sequence and a decode step's 1 row must agree, or greedy speculative decoding diverges):
the keys are reduced over a fixed grid of 256-key chunks, each chunk's online softmax from a
fresh state, and the chunks' partial softmaxes (max, sum, unnormalised output) folded in
chunk order by one out-of-line function. When the items are too few to keep every thread
busy (batch-1 decode, one long prefill tile) a long item is split over its chunks; each part
leaves its chunks' partials in slots, and a merge step folds them as an unsplit item would:

    batch-1 decode, 1024 keys, 2 threads: 4 parts, each taken by whichever thread is free
      [chunk 0: keys 0..255] [chunk 1] [chunk 2] [chunk 3]
           |                    |          |         |
           +--------------------+----------+---------+--> fold in order: (m, l, o) with
                 (m_c, l_c, o_c): m' = max(m, m_c), l' = l e^(m - m') + l_c e^(m_c - m'),
                 o' likewise; out = o / l

Inside an item, per key block and kv head, for each row the G query heads that share the kv
head go together: 16 dot products each (bf16 rows multiplied in pairs by AVX512-BF16, f32 ones
by FMAs, with a transpose-and-add for the 16 sums), an online-softmax update, and P @ V with
each V row loaded once for all G heads. The pages two blocks ahead are prefetched a few
cache lines at a time between these steps (a burst of prefetches stalls the core instead).
Keys past an item's last row are never touched; within a tile the keys a row may not see are
masked by selection before any arithmetic. With a sliding window an item's key blocks start at
the block of its first row's window (pages wholly before it are never read), and the keys of
that block before the window are never read either; the logit soft cap applies to each block's
scores before its softmax update.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import native_library
from jaxllm.kernels.native_library import Availability

TARGET = "jaxllm_ragged_paged_attention"
_LIB_STEM = "_cpu_attention"


def library_path() -> str | None:
    return native_library.find(_LIB_STEM)


def _load_library() -> Availability:
    return native_library.open_library(_LIB_STEM, library_path(), "JaxllmRaggedPagedAttention")


@functools.cache
def availability() -> Availability:
    """Loads the library once per process (tests clear this cache to simulate its absence)."""
    return _load_library()


@functools.cache
def _registered() -> None:
    status = availability()
    if not status:
        raise RuntimeError(f'attention backend "cpu" is unavailable: {status.reason}')
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(status.lib.JaxllmRaggedPagedAttention),
                                platform="cpu")


def num_threads() -> int:
    """Threads the library's pool runs attention on, the caller's included."""
    _registered()
    fn = availability().lib.JaxllmCpuAttentionNumThreads
    fn.restype = ctypes.c_int
    return int(fn())


def _check_dtypes(q, k_cache, v_cache) -> None:
    q_dtype, c_dtype = jnp.dtype(q.dtype), jnp.dtype(k_cache.dtype)
    if jnp.dtype(v_cache.dtype) != c_dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {c_dtype} vs {v_cache.dtype}")
    ok = {jnp.dtype(jnp.float32): (jnp.dtype(jnp.float32),),
          jnp.dtype(jnp.bfloat16): (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16)),
          jnp.dtype(jnp.float16): (jnp.dtype(jnp.float16), jnp.dtype(jnp.uint16))}
    if c_dtype not in ok.get(q_dtype, ()):
        raise ValueError(f"q dtype {q_dtype} with cache dtype {c_dtype}: the cpu backend takes "
                         "float32 q with a float32 cache, or bfloat16 / float16 q with a cache "
                         "of the same type or uint16 holding its bits")


def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           num_seqs, *, sm_scale, sliding_window=None, logits_soft_cap=None):
    """Same signature and semantics as kernels/reference.py. A uint16 cache holds q.dtype's
    bits (models/layers.py kv_storage_dtype)."""
    T, N, H = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != H:
        raise ValueError(f"caches must both be [num_blocks, block_size, K, {H}], got "
                         f"{k_cache.shape} and {v_cache.shape}")
    K = k_cache.shape[2]
    if N % K:
        raise ValueError(f"query heads {N} are not a multiple of kv heads {K}")
    S = block_tables.shape[0]
    if seq_lens.shape != (S,) or query_start_loc.shape != (S + 1,):
        raise ValueError(f"seq_lens must be [{S}] and query_start_loc [{S + 1}], got "
                         f"{seq_lens.shape} and {query_start_loc.shape}")
    _check_dtypes(q, k_cache, v_cache)
    _registered()
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, k_cache, v_cache, i32(block_tables), i32(seq_lens), i32(query_start_loc),
                i32(num_seqs).reshape(()), sm_scale=np.float32(sm_scale),
                # 0: no window / no cap (the library's encoding of None).
                sliding_window=np.int32(sliding_window or 0),
                logits_soft_cap=np.float32(logits_soft_cap or 0.0))
