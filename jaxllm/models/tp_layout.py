"""How a checkpoint is laid out over `tp` devices: KV heads each device keeps, padded vocab.

Owns: the checks a tensor-parallel size must pass for a model (ValueError naming both
values), the KV heads each device keeps when `tp` does not divide the KV heads, the vocabulary
padded to a multiple of `tp`, the model config that results, and the rewrite of checkpoint
tensors into it. Never places anything on a device (models/sharding.py does) and never
imports jax.

KV heads. Each device runs N/tp query heads and keeps the KV heads they read. Devices get
query heads in order; a device's query heads form groups of g = gcd(N/tp, G) consecutive
heads that share one KV head (G = N/K), so the device keeps (N/tp)/g KV heads in the
kernel's usual layout (local query head i reads local KV head i // g). The model is then
built with tp * (N/tp)/g KV heads, each a copy of a checkpoint head:

    N=8, K=2 (G=4), tp=2: g=4, 1 head per device  -> heads [0 | 1]            (no copy)
    N=8, K=2,      tp=4: g=2, 1 head per device  -> heads [0 | 0 | 1 | 1]    (2x)
    N=9, K=3,      tp=3: g=3, 1 head per device  -> heads [0 | 1 | 2]        (no copy)

When tp divides K, or K divides tp (and then G is a multiple of N/tp), this is exactly one
copy per device that needs a head, as vLLM replicates. Otherwise a device may keep one
checkpoint head twice (groups must be uniform for the kernels); the log says what it costs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Iterator

import numpy as np

from jaxllm.models.config import ModelConfig

_KV_PROJ = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")
_VOCAB_ROWS = re.compile(r"^(model\.embed_tokens\.weight|lm_head\.weight)$")


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    checkpoint_config: ModelConfig
    tensor_parallel_size: int
    kv_head_map: tuple[int, ...]  # checkpoint KV head of each of the model's KV heads

    @classmethod
    def create(cls, cfg: ModelConfig, tensor_parallel_size: int) -> "TensorParallelLayout":
        tp = tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        n, k = cfg.num_attention_heads, cfg.num_key_value_heads
        if n % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's "
                             f"num_attention_heads={n} (each device runs whole query heads); "
                             f"choose one of {_divisors(n)}")
        if cfg.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's "
                             f"intermediate_size={cfg.intermediate_size} (each device runs "
                             f"whole MLP columns); choose one of "
                             f"{_divisors(math.gcd(n, cfg.intermediate_size))}")
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            width = getattr(cfg, key) if cfg.num_experts else 0
            if width % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide the model's {key}="
                                 f"{width} (each device runs whole expert columns); choose "
                                 f"one of {_divisors(math.gcd(n, width))}")
        local_q = n // tp
        group = math.gcd(local_q, n // k)
        heads = [(d * local_q + j * group) // (n // k)
                 for d in range(tp) for j in range(local_q // group)]
        return cls(cfg, tp, tuple(heads))

    @property
    def num_kv_heads_per_device(self) -> int:
        return len(self.kv_head_map) // self.tensor_parallel_size

    @property
    def kv_replication(self) -> float:
        """KV cache bytes against the checkpoint's heads (1.0: no head is kept twice)."""
        return len(self.kv_head_map) / self.checkpoint_config.num_key_value_heads

    @property
    def model_config(self) -> ModelConfig:
        cfg, tp = self.checkpoint_config, self.tensor_parallel_size
        padded = -(-cfg.vocab_size // tp) * tp
        return dataclasses.replace(
            cfg, num_key_value_heads=len(self.kv_head_map),
            padded_vocab_size=None if padded == cfg.vocab_size else padded)

    def describe_replication(self) -> str | None:
        """One line for the log when KV heads are kept on several devices, else None."""
        if self.kv_replication == 1:
            return None
        k = self.checkpoint_config.num_key_value_heads
        return (f"tensor_parallel_size={self.tensor_parallel_size} with {k} KV heads: each "
                f"device keeps {self.num_kv_heads_per_device} KV head(s) (checkpoint heads "
                f"{list(self.kv_head_map)} across devices), so the KV cache holds "
                f"{self.kv_replication:g}x the bytes per token of an unreplicated cache "
                f"({self.kv_replication:g}x fewer tokens fit the same memory)")

    def adapt(self, tensors: Iterable[tuple[str, np.ndarray]]
              ) -> Iterator[tuple[str, np.ndarray]]:
        """Checkpoint tensors (HF names and layouts) -> this layout's: k/v projections get
        the kept heads' rows, the embedding and LM head zero rows up to the padded vocab."""
        cfg = self.model_config
        identity_kv = self.kv_head_map == tuple(range(self.checkpoint_config.num_key_value_heads))
        pad = cfg.num_embeddings - cfg.vocab_size
        for name, tensor in tensors:
            if (not identity_kv and _KV_PROJ.search(name)
                    and tensor.shape[0] == self.checkpoint_config.num_key_value_heads
                    * cfg.head_dim):  # a misshapen one is left for the loader's shape check
                # [K * H, ...] rows grouped by head -> the kept heads' rows, in order.
                rows = tensor.reshape(-1, cfg.head_dim, *tensor.shape[1:])
                tensor = rows[list(self.kv_head_map)].reshape(-1, *tensor.shape[1:])
            elif pad and _VOCAB_ROWS.match(name):
                tensor = np.concatenate(
                    [tensor, np.zeros((pad, *tensor.shape[1:]), tensor.dtype)])
            yield name, tensor


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
