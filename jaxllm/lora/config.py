"""The engine's LoRA arguments (vLLM's LoRAConfig): checked once, at EngineConfig.

Owns the allowed values and their defaults (vLLM's: max_loras 1, max_lora_rank 16,
max_cpu_loras = max_loras, lora_dtype "auto" = the model's dtype). Never loads an adapter.
"""

from __future__ import annotations

import dataclasses

# vLLM's allowed ranks (its MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # distinct adapters in one step (device weight slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in host memory (LRU)
    lora_dtype: str = "auto"

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an int, got {type(value).__name__}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {MAX_LORA_RANKS}, got "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got "
                             f"{self.lora_dtype!r}")


def lora_config_of(engine_config) -> LoRAConfig | None:
    """The checked LoRAConfig of an EngineConfig (None: enable_lora is False)."""
    if not isinstance(engine_config.enable_lora, bool):
        raise ValueError(f"enable_lora must be a bool, got "
                         f"{type(engine_config.enable_lora).__name__}")
    config = LoRAConfig(engine_config.max_loras, engine_config.max_lora_rank,
                        engine_config.max_cpu_loras, engine_config.lora_dtype)
    return config if engine_config.enable_lora else None
