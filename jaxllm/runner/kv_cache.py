"""How many KV blocks fit: the one place that turns bytes into `num_blocks`.

Priority: num_gpu_blocks_override (tests) > kv_cache_memory_bytes > gpu_memory_utilization of
the accelerator's memory (minus what the weights already hold) > CPU default of 512 MiB.
Budgets are per device, as vLLM's kv_cache_memory_bytes: under tensor parallelism each device
holds its KV heads' share of every block. A budget too small for one max_model_len request is
refused here, where the bytes are known, so the error can say how many bytes one block needs;
the count is never negative.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from jaxllm.kv_capacity import check_fits
from jaxllm.models.config import ModelConfig


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype,
                       tensor_parallel_size: int = 1) -> int:
    """Bytes of one block on each device: K and V, every layer, block_size tokens of the
    device's K / tp heads x H. cfg: the loaded model's (its KV heads a multiple of tp)."""
    return (2 * cfg.num_hidden_layers * block_size
            * (cfg.num_key_value_heads // tensor_parallel_size) * cfg.head_dim
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


def determine_num_blocks(config: EngineConfig, cfg: ModelConfig, dtype,
                         tensor_parallel_size: int = 1) -> int:
    """Blocks (the null block included) the budget of each device holds; ValueError if one
    request of config.max_model_len (when set) would not fit."""
    per_block = kv_bytes_per_block(cfg, config.block_size, dtype, tensor_parallel_size)
    budget_bytes = None
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    else:
        # On an accelerator whose memory the weights already fill, the budget is negative.
        budget_bytes = max(0, available_kv_bytes(config))
        num_blocks = budget_bytes // per_block
    if config.max_model_len is not None:
        check_fits(num_blocks, config.block_size, config.max_model_len,
                   bytes_per_block=per_block, budget_bytes=budget_bytes)
    return num_blocks
