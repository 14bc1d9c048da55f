"""How many KV blocks fit: the one place that turns bytes into `num_blocks`.

Priority: num_gpu_blocks_override (tests) > kv_cache_memory_bytes > gpu_memory_utilization of
the accelerator's memory (minus what the weights already hold) > CPU default of 1 GiB.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from jaxllm.models.config import ModelConfig


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    # K and V, every layer, block_size tokens of K heads x H.
    return (2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim
            * np.dtype(dtype).itemsize)


def available_kv_bytes(config: EngineConfig) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return CPU_DEFAULT_KV_CACHE_BYTES
    budget = stats["bytes_limit"] * config.gpu_memory_utilization - stats.get("bytes_in_use", 0)
    # Leave room for activations and logits of the largest bucket: 10% of what is left.
    return int(budget * 0.9)


def determine_num_blocks(config: EngineConfig, cfg: ModelConfig, dtype) -> int:
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    return max(0, available_kv_bytes(config) // kv_bytes_per_block(cfg, config.block_size, dtype))
