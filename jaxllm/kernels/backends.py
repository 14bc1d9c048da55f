"""Attention backends as objects: what each stores, where it runs, how it runs per shard.

Owns: the four backends ("cpu", "xla", "pallas", "pallas_interpret"), the KV write that goes
with each one's storage, the choice of a default by asking the backends in order of
preference, and the one warning a user sees when the preferred one cannot run. The kernels
themselves live beside this file (cpu_attention.py, xla_attention.py, paged_attention.py).
Must never: pick a backend silently in place of the one the platform prefers, accept a
backend that cannot run here (a ValueError names it, the platform and why), or run the KV
write and the kernel anywhere but on each device's own KV heads (see `per_shard_specs`).

Per shard. Under tensor parallelism every backend runs the same way, inside
`jax.shard_map` over the "tp" axis: the new q/k/v are split by heads, the cache by KV heads,
and the metadata is replicated, so each device writes and reads only its own heads and the
SPMD partitioner never sees the kernel (an opaque custom call it would gather inputs for):

    q  [T, N, H]            -> device d: q  [T, N/tp, H]
    k, v new [T, K, H]      -> device d: [T, K/tp, H]
    cache [B, P, K, H]      -> device d: [B, P, K/tp, H]     (K: the loaded model's KV heads,
    metadata (block tables, seq_lens, ...): whole on every device   replicated if tp > K)
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# Mesh axis of tensor parallelism, named once for the package (models/sharding.py uses it).
TP_AXIS = "tp"

_HEADS = P(None, TP_AXIS, None)  # [T, heads, H]
_CACHE = P(None, None, TP_AXIS, None)  # [B, P, K, H]
_WHOLE = P()


class AttentionBackend:
    """One attention backend. Subclasses set `name`, `platforms` and the kernel."""

    name: str = ""
    platforms: tuple[str, ...] = ()  # jax platforms it runs on ("cpu", "gpu")
    # Attention options (keyword-only, static; see kernels/reference.py): a backend that
    # lacks one refuses it (`check_options`) rather than attend in full.
    supports_sliding_window: bool = False
    supports_logits_soft_cap: bool = False
    # Under tensor parallelism: (q, k_new, v_new, (k_cache, v_cache), metadata) -> specs.
    per_shard_specs = (_HEADS, _HEADS, _HEADS, (_CACHE, _CACHE), _WHOLE)
    per_shard_out_specs = (_HEADS, (_CACHE, _CACHE))

    def unavailable_reason(self, platform: str) -> str | None:
        """Why this backend cannot run on `platform` (a jax platform name), or None."""
        if platform not in self.platforms:
            return f"it runs on {' or '.join(self.platforms)}, not {platform}"
        return None

    def kv_storage_dtype(self, dtype) -> jnp.dtype:
        """What the KV cache arrays hold for a model computing in `dtype`."""
        return jnp.dtype(dtype)

    def attention_fn(self):
        """The kernel, with the signature of kernels/reference.py."""
        raise NotImplementedError

    def check_options(self, *, sliding_window=None, logits_soft_cap=None) -> dict:
        """The attention options as the kernel's keywords (only those set); a ValueError
        naming this backend and the option when it lacks one or the value is out of range."""
        options = {}
        if sliding_window is not None:
            if not self.supports_sliding_window:
                raise ValueError(f'attention backend "{self.name}" does not support '
                                 f"sliding_window (got {sliding_window})")
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
                    or sliding_window < 1:
                raise ValueError(f"sliding_window must be an int >= 1 or None, got "
                                 f"{sliding_window!r}")
            options["sliding_window"] = sliding_window
        if logits_soft_cap is not None:
            if not self.supports_logits_soft_cap:
                raise ValueError(f'attention backend "{self.name}" does not support '
                                 f"logits_soft_cap (got {logits_soft_cap})")
            if isinstance(logits_soft_cap, bool) or \
                    not isinstance(logits_soft_cap, (int, float)) or not logits_soft_cap > 0:
                raise ValueError(f"logits_soft_cap must be a float > 0 or None, got "
                                 f"{logits_soft_cap!r}")
            options["logits_soft_cap"] = float(logits_soft_cap)
        return options

    def write_and_attend(self, q_TNH, k_TKH, v_TKH, kv, md, *, sm_scale, sliding_window=None,
                         logits_soft_cap=None):
        """Write this step's K/V rows into the cache, then attend (one device's heads).
        sliding_window / logits_soft_cap: see kernels/reference.py (static Python values).
        -> (o [T, N, H], (k_cache, v_cache))."""
        options = self.check_options(sliding_window=sliding_window,
                                     logits_soft_cap=logits_soft_cap)
        k_cache, v_cache = kv
        k_cache = write_kv(k_cache, k_TKH, md.slot_mapping)
        v_cache = write_kv(v_cache, v_TKH, md.slot_mapping)
        o_TNH = self.attention_fn()(q_TNH, k_cache, v_cache, md.block_tables, md.seq_lens,
                                    md.query_start_loc, md.num_seqs, sm_scale=sm_scale,
                                    **options)
        return o_TNH, (k_cache, v_cache)

    def __repr__(self) -> str:
        return f"AttentionBackend({self.name!r})"


def write_kv(cache_CPKH, new_TKH, slot_mapping_T):
    """Scatter new K or V rows into their cache slots (in place when the cache is donated).

    A uint16 cache holds 16-bit floats as bits (see `BitsOnCpu`): the new rows are bitcast
    to it. The slot is split into (block, offset) rather than writing a [C * P, K, H]
    reshape: with one KV head per device (K = 1) XLA:CPU lays that reshape out unlike the
    cache and copies the whole cache around the write."""
    P_ = cache_CPKH.shape[1]
    if cache_CPKH.dtype == jnp.uint16:
        new_TKH = jax.lax.bitcast_convert_type(new_TKH, jnp.uint16)
    return cache_CPKH.at[slot_mapping_T // P_, slot_mapping_T % P_].set(
        new_TKH.astype(cache_CPKH.dtype))


class BitsOnCpu(AttentionBackend):
    """A 16-bit float cache stored as uint16 bits. XLA:CPU has no bf16/f16 scatter: rather
    than fail it converts the whole cache to f32 and back around the write, two full passes
    over every layer's cache per step (a bitcast of the whole cache is a copy there too).
    The XLA attention bitcasts the rows it gathers back; the C++ one reads the bits as q's
    dtype."""

    def kv_storage_dtype(self, dtype) -> jnp.dtype:
        dtype = jnp.dtype(dtype)
        if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating):
            return jnp.dtype(jnp.uint16)
        return dtype


class XlaBackend(BitsOnCpu):
    """Pure XLA, work in proportion to each sequence's context (kernels/xla_attention.py)."""

    name, platforms = "xla", ("cpu", "gpu", "tpu")
    supports_sliding_window = supports_logits_soft_cap = True

    def attention_fn(self):
        from jaxllm.kernels.xla_attention import ragged_paged_attention
        return ragged_paged_attention


class CpuBackend(BitsOnCpu):
    """The C++ kernel through XLA FFI (kernels/cpu_attention.py), when its library loads."""

    name, platforms = "cpu", ("cpu",)
    supports_sliding_window = supports_logits_soft_cap = True

    def unavailable_reason(self, platform: str) -> str | None:
        from jaxllm.kernels import cpu_attention
        status = cpu_attention.availability()
        return super().unavailable_reason(platform) or (None if status else status.reason)

    def attention_fn(self):
        from jaxllm.kernels import cpu_attention
        return cpu_attention.ragged_paged_attention


class PallasBackend(AttentionBackend):
    """The Pallas Triton kernel (kernels/paged_attention.py) on NVIDIA GPUs."""

    name, platforms = "pallas", ("gpu",)
    supports_sliding_window = supports_logits_soft_cap = True
    interpret = False

    def attention_fn(self):
        from jaxllm.kernels.paged_attention import ragged_paged_attention
        return functools.partial(ragged_paged_attention, interpret=self.interpret)


class PallasInterpretBackend(PallasBackend):
    """The same kernel run by the Pallas interpreter (testing it without a GPU)."""

    name, platforms = "pallas_interpret", ("cpu", "gpu")
    interpret = True


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b for b in (XlaBackend(), CpuBackend(), PallasBackend(), PallasInterpretBackend())}
# Tried in order on each platform; the first that can run is the default.
PREFERRED = {"cpu": ("cpu", "xla"), "gpu": ("pallas", "xla")}
# What falling back costs, measured (benchmarks/attention_bench.py), for the warning.
_FALLBACK_COST = {
    "cpu": 'attention in "xla" took 2.2x-10x the C++ kernel\'s time per call in '
           "benchmarks/attention_bench.py (2-core AVX-512 CPU, SmolLM2 shapes)",
    "pallas": 'attention in "xla" reads the paged cache through XLA gathers, not a fused '
              "GPU kernel",
}


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {tuple(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def _platform_key(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def select_backend(name: str | None, platform: str | None = None) -> AttentionBackend:
    """The backend named (ValueError if it cannot run on `platform`), or the platform's
    preferred one that can run. Falling back from the preferred one warns once, with the
    reason and the cost. platform: a jax platform (default: jax.default_backend())."""
    platform = _platform_key(platform or jax.default_backend())
    if name is not None:
        backend = get_backend(name)
        reason = backend.unavailable_reason(platform)
        if reason is not None:
            raise ValueError(f'attention_backend="{name}" cannot run on platform '
                             f'"{platform}": {reason}')
        return backend
    preferred = PREFERRED.get(platform, ("xla",))
    for candidate in preferred:
        backend = BACKENDS[candidate]
        if backend.unavailable_reason(platform) is None:
            if candidate != preferred[0]:
                _warn_fallback(preferred[0], candidate, platform)
            return backend
    raise ValueError(f"no attention backend can run on platform {platform!r}")


@functools.cache
def _warn_fallback(preferred: str, chosen: str, platform: str) -> None:
    reason = BACKENDS[preferred].unavailable_reason(platform)
    warnings.warn(f'attention backend "{preferred}" is unavailable ({reason}); using '
                  f'"{chosen}" instead, which is slower: {_FALLBACK_COST[preferred]}',
                  RuntimeWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """A backend bound to a mesh: the attention call of every decoder layer.

    mesh None or of one device: the backend runs as is. Otherwise it runs per shard (see
    the module docstring)."""

    backend: AttentionBackend
    mesh: jax.sharding.Mesh | None = None

    def __call__(self, q_TNH, k_TKH, v_TKH, kv, md, *, sm_scale, sliding_window=None,
                 logits_soft_cap=None):
        # Checked here too, so a refused option fails before shard_map traces anything.
        self.backend.check_options(sliding_window=sliding_window,
                                   logits_soft_cap=logits_soft_cap)
        fn = functools.partial(self.backend.write_and_attend, sm_scale=sm_scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        if self.mesh is None or self.mesh.size == 1:
            return fn(q_TNH, k_TKH, v_TKH, kv, md)
        # check_vma=False: the kernels (FFI and Pallas calls) carry no varying-axes rules;
        # the specs above state what varies.
        return jax.shard_map(fn, mesh=self.mesh, in_specs=self.backend.per_shard_specs,
                             out_specs=self.backend.per_shard_out_specs,
                             check_vma=False)(q_TNH, k_TKH, v_TKH, kv, md)
