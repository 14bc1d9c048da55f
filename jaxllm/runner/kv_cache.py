"""How many KV blocks fit: the one place that turns bytes into `num_blocks`.

Priority: num_gpu_blocks_override (tests) > kv_cache_memory_bytes > an accelerator's memory
> CPU default of 512 MiB. All bytes are per device, as vLLM's kv_cache_memory_bytes: under
tensor parallelism each device holds its KV heads' share of every block (models/tp_layout.py
makes the model's KV heads a multiple of the tensor-parallel size).

On an accelerator (a device whose `memory_stats()` reports a `bytes_limit`) the order is
vLLM's: profile, then allocate. The runner is built without a KV cache, the step of the
largest token bucket is compiled against an abstract cache (`ModelRunner.profile_run`), and
XLA's memory analysis of it gives what a step needs beyond the persistent state; then

    num_blocks = (bytes_limit * gpu_memory_utilization   the budget
                  - bytes_in_use                          weights, token history
                  - step temporaries                      activations, logits, sampler
                  - 2 x step inputs/outputs)              metadata, tokens, logprobs
                 // per-device bytes of one block

The temporaries do not depend on num_blocks (the cache is donated and updated in place), so
the profile compiles at a provisional count, the most blocks that could fit. They grow with
the token bucket (activations [T, D], logits [S, V] with S = min(T, max_num_seqs)), so the
largest bucket bounds them; every bucket compiled afterwards is checked against the
reservation (`KVCacheSizing.check`), and a larger one is an error at start-up, never an
out-of-memory at serve time (with enforce_eager, a warning as the bucket compiles). The
profile costs one compile of the largest bucket, not reused (its cache size differs), also
with enforce_eager; JAX's persistent compilation cache keeps it for the next start-up on the
same device. On GPUs `bytes_limit` is what JAX's allocator may take
(XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 of the device unless set), not the whole device.

A budget too small for one max_model_len request is refused here, where the bytes are known,
so the error can say how many bytes one block needs; the count is never negative.
Never imports the model runner (it passes its measurements in) and never allocates.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from jaxllm.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from jaxllm.kv_capacity import check_fits
from jaxllm.models.config import ModelConfig

# Reserved for temporaries when XLA cannot say (a compiled step without memory analysis):
# this fraction of what the weights leave of the budget.
FLAT_MARGIN = 0.1


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """An accelerator's memory as jax reports it (`Device.memory_stats()`), in bytes."""

    bytes_limit: int
    bytes_in_use: int


def device_memory(devices: Iterable) -> DeviceMemory | None:
    """The tightest of `devices` (smallest limit, largest use), or None on CPU or where a
    device reports no bytes_limit (then the CPU default applies)."""
    found = []
    for device in devices:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            return None
        found.append(DeviceMemory(int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))))
    if not found:
        return None
    return DeviceMemory(min(m.bytes_limit for m in found), max(m.bytes_in_use for m in found))


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of arrays or ShapeDtypeStructs (its shards)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.shape if getattr(x, "sharding", None) is None else \
            x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype, tp: int = 1) -> int:
    """One block on one device: K and V, every layer, block_size tokens of its K / tp heads
    x H. cfg: the loaded model's (models/tp_layout.py: its KV heads a multiple of tp)."""
    if cfg.num_key_value_heads % tp:
        raise ValueError(f"num_key_value_heads={cfg.num_key_value_heads} is not a multiple of "
                         f"tp={tp}: pass the config of the model as laid out for tp "
                         f"(TensorParallelLayout.model_config)")
    return (2 * cfg.num_hidden_layers * block_size
            * (cfg.num_key_value_heads // tp) * cfg.head_dim
            * np.dtype(dtype).itemsize)


def flat_margin_kv_bytes(memory: DeviceMemory, gpu_memory_utilization: float) -> int:
    """The KV bytes a flat margin gives: (1 - FLAT_MARGIN) of what the weights leave."""
    free = memory.bytes_limit * gpu_memory_utilization - memory.bytes_in_use
    return max(0, int(free * (1 - FLAT_MARGIN)))


def needs_profile(config: EngineConfig, memory: DeviceMemory | None) -> bool:
    """Whether num_blocks comes from the device's memory (and so from a profile)."""
    return (memory is not None and config.num_gpu_blocks_override is None
            and config.kv_cache_memory_bytes is None)


def provisional_num_blocks(config: EngineConfig, memory: DeviceMemory,
                           bytes_per_block: int) -> int:
    """The block count to profile at: the most that could fit with no temporaries (at least
    1). The step's temporaries do not depend on it; the closer to the final count, the
    closer the profiled program is to the one that will run."""
    free = memory.bytes_limit * config.gpu_memory_utilization - memory.bytes_in_use
    return max(1, int(free) // bytes_per_block)


# Steps whose inputs and outputs can be alive at once: with async scheduling the host
# uploads step N+1's inputs while step N runs and before step N-1's outputs are fetched.
STEPS_IN_FLIGHT = 2


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What one compiled step needs beyond the state that persists (weights, KV cache,
    token history), per device, from XLA's memory analysis."""

    temp_bytes: int  # temporaries: activations, logits, the sampler's work
    io_bytes: int  # its other inputs (metadata) and the outputs not written in place

    @classmethod
    def of(cls, analysis, persistent_bytes: int) -> "StepMemory | None":
        """From a compiled step's memory analysis (None: none on this platform) and the
        bytes of its arguments that persist between steps."""
        if analysis is None:
            return None
        io = (analysis.argument_size_in_bytes - persistent_bytes
              + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
        return cls(temp_bytes=int(analysis.temp_size_in_bytes), io_bytes=max(0, int(io)))

    @property
    def reserve_bytes(self) -> int:
        return self.temp_bytes + STEPS_IN_FLIGHT * self.io_bytes


@dataclasses.dataclass(frozen=True)
class KVCacheSizing:
    """The figures behind num_blocks on an accelerator, per device, in bytes."""

    budget_bytes: int  # bytes_limit * gpu_memory_utilization
    in_use_bytes: int  # before the KV cache: weights, token history
    reserved_bytes: int  # for a step's temporaries and inputs/outputs
    reserved_for: str  # what reserved_bytes is (a bucket's figures, or the flat margin)
    bytes_per_block: int
    num_blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        return (f"KV cache sizing (per device): budget {gib(self.budget_bytes)}; in use "
                f"before the KV cache (weights, token history) {gib(self.in_use_bytes)}; "
                f"reserved for a step {gib(self.reserved_bytes)} ({self.reserved_for}); KV "
                f"cache {gib(self.kv_bytes)} = {self.num_blocks} blocks of "
                f"{self.bytes_per_block} bytes")

    def excess(self, steps: Mapping[tuple, StepMemory | None]) -> dict[tuple, int]:
        """Buckets whose compiled step needs more than the reservation, and by how much."""
        return {key: m.reserve_bytes - self.reserved_bytes for key, m in steps.items()
                if m is not None and m.reserve_bytes > self.reserved_bytes}

    def check(self, steps: Mapping[tuple, StepMemory | None]) -> None:
        """RuntimeError if a compiled bucket needs more than was reserved: with the KV cache
        filling the budget, it would run out of memory when it runs."""
        over = self.excess(steps)
        if over:
            key, extra = max(over.items(), key=lambda kv: kv[1])
            raise RuntimeError(
                f"the compiled step for bucket {key} needs {self.reserved_bytes + extra} bytes "
                f"of temporaries and inputs/outputs, {extra} more than the "
                f"{self.reserved_bytes} reserved ({self.reserved_for}); with the KV cache at "
                f"{self.kv_bytes} bytes it would run out of device memory. Set "
                f"kv_cache_memory_bytes <= {max(0, self.kv_bytes - extra)} or lower "
                f"gpu_memory_utilization.")

    def warn_if_over(self, key: tuple, step: StepMemory | None) -> None:
        """For buckets compiled while serving (enforce_eager): warn, the step may still fit."""
        if self.excess({key: step}):
            warnings.warn(
                f"the step compiled for bucket {key} needs {step.reserve_bytes} bytes of "
                f"temporaries and inputs/outputs, more than the {self.reserved_bytes} reserved "
                f"({self.reserved_for}); it may run out of device memory. Without "
                f"enforce_eager every bucket is checked at start-up.", RuntimeWarning,
                stacklevel=2)


def size_from_profile(config: EngineConfig, memory: DeviceMemory, bytes_per_block: int,
                      steps: Mapping[tuple, StepMemory | None]) -> KVCacheSizing:
    """Size the cache from the profiled buckets (bucket -> StepMemory; None where XLA gave
    no memory analysis: then the flat margin, with a warning)."""
    budget = int(memory.bytes_limit * config.gpu_memory_utilization)
    known = {key: m for key, m in steps.items() if m is not None}
    if known:
        key = max(known, key=lambda k: known[k].reserve_bytes)
        m = known[key]
        reserved = m.reserve_bytes
        reserved_for = (f"bucket {key}: temporaries {m.temp_bytes} + {STEPS_IN_FLIGHT} x "
                        f"inputs/outputs {m.io_bytes} bytes, XLA's memory analysis")
    else:
        reserved = budget - memory.bytes_in_use - flat_margin_kv_bytes(
            memory, config.gpu_memory_utilization)
        reserved_for = f"flat {FLAT_MARGIN:.0%} margin"
        warnings.warn(f"the compiled step has no memory analysis on this platform: "
                      f"reserving a {reserved_for} of the free device memory for its "
                      f"temporaries instead of their measured size", RuntimeWarning,
                      stacklevel=2)
    reserved = max(0, reserved)
    kv = max(0, budget - memory.bytes_in_use - reserved)
    return KVCacheSizing(budget_bytes=budget, in_use_bytes=memory.bytes_in_use,
                         reserved_bytes=reserved, reserved_for=reserved_for,
                         bytes_per_block=bytes_per_block, num_blocks=kv // bytes_per_block)


def determine_num_blocks(config: EngineConfig, cfg: ModelConfig, dtype, *, tp: int = 1,
                         sizing: KVCacheSizing | None = None) -> int:
    """Blocks (the null block included) the budget holds; ValueError if one request of
    config.max_model_len (when set) would not fit. `sizing`: an accelerator's profile-based
    figures (used unless the config overrides them)."""
    per_block = kv_bytes_per_block(cfg, config.block_size, dtype, tp)
    budget_bytes = None
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif config.kv_cache_memory_bytes is not None or sizing is None:
        budget_bytes = config.kv_cache_memory_bytes or CPU_DEFAULT_KV_CACHE_BYTES
        num_blocks = budget_bytes // per_block
    else:
        budget_bytes, num_blocks = sizing.kv_bytes, sizing.num_blocks
    if config.max_model_len is not None:
        check_fits(num_blocks, config.block_size, config.max_model_len,
                   bytes_per_block=per_block, budget_bytes=budget_bytes)
    return num_blocks
