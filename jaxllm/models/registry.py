"""Architecture registry: ModelConfig.architecture -> model class.

Owns the set of supported architecture names. The architecture itself is chosen in
`config.py` (`architectures[0]`, or the `model_type` fallback), which must not import jax.
"""

from __future__ import annotations

from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.mixtral import MixtralForCausalLM

# Mistral, Qwen2 and Qwen3 are Llama with config flags (attention_bias, qk_norm): one class.
_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Mixtures of experts (models/moe.py); Qwen2-MoE/Qwen3-MoE differ by config flags.
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": MixtralForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(cfg: ModelConfig):
    try:
        return _MODELS[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {cfg.architecture!r} is not supported by jaxllm. "
            f"Supported architectures: {', '.join(supported_architectures())}") from None
