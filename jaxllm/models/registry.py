"""Architecture registry: ModelConfig.architecture -> model class.

Owns the set of supported architecture names. The architecture itself is chosen in
`config.py` (`architectures[0]`, or the `model_type` fallback), which must not import jax.
"""

from __future__ import annotations

from jaxllm.models.bert import BertForSequenceClassification, BertModel
from jaxllm.models.config import ModelConfig
from jaxllm.models.decoder_pooling import DecoderForEmbedding, DecoderForSequenceClassification
from jaxllm.models.gemma import GemmaForCausalLM
from jaxllm.models.gpt2 import GPT2LMHeadModel
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.mixtral import MixtralForCausalLM
from jaxllm.models.opt import OPTForCausalLM
from jaxllm.models.phi3 import Phi3ForCausalLM

# Mistral, Qwen2 and Qwen3 are Llama with config flags (attention_bias, qk_norm): one class.
# Phi-3 is Llama with its fused tensors split at load; GPT-2 is OPT with other names.
_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Mixtures of experts (models/moe.py); Qwen2-MoE/Qwen3-MoE differ by config flags.
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": MixtralForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # Gemma 2 and 3 are Gemma with config flags (sandwich norms, soft-caps, windows).
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}

# Pooling models (jaxllm/pooling/), apart so that the generative list stays the model_type
# fallback's: encoders, and Llama-family decoders that embed or classify (`*Model` is also
# what convert="embed" makes of a `*ForCausalLM`).
_POOLING_MODELS = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    **{f"{family}Model": DecoderForEmbedding
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3")},
    **{f"{family}ForSequenceClassification": DecoderForSequenceClassification
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3")},
}
POOLING_ARCHITECTURES = frozenset(_POOLING_MODELS)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(cfg: ModelConfig):
    try:
        return _MODELS.get(cfg.architecture) or _POOLING_MODELS[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {cfg.architecture!r} is not supported by jaxllm. "
            f"Supported architectures: {', '.join(supported_architectures())}; pooling "
            f"models: {', '.join(sorted(POOLING_ARCHITECTURES))}") from None


def kv_sliding_window(cfg: ModelConfig) -> int | None:
    """The sliding window every layer of cfg's model attends with, or None: then the KV blocks
    wholly before a request's window may be given back (engine/kv_cache_manager.py). The
    Llama family applies cfg.sliding_window to every layer; a family with a per-layer pattern
    (global layers read the whole context) must not be listed here."""
    return cfg.sliding_window if get_model_class(cfg) is LlamaForCausalLM else None
