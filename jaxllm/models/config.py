"""ModelConfig: the architecture facts a jaxllm model needs, built once from an HF config.

Owns: translating `config.json` (or GGUF metadata turned into the same dict) into a frozen,
validated dataclass. Never imports jax: the scheduler and the loader read it too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always for Qwen2)
    o_proj_bias: bool = False  # bias on o_proj too (Llama/Mistral/Qwen3 `attention_bias`)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a `config.json` dict (or a transformers PretrainedConfig.to_dict())."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config has no 'architectures' entry; cannot pick a model class")
        arch = archs[0]
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if hf.get("sliding_window") and hf.get("use_sliding_window", True) and \
                arch == "MistralForCausalLM":
            # Mistral v0.1 uses a 4096-token window; later Mistrals set it to null. We only
            # implement full attention, so limit the context to the window instead of
            # silently computing something else.
            max_pos = min(int(hf.get("max_position_embeddings", 2048)), int(hf["sliding_window"]))
        else:
            max_pos = int(hf.get("max_position_embeddings", 2048))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(hf)),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
        )


def _rope_params(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`.
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: Mapping[str, Any]) -> float:
    if "rope_theta" in hf:
        return hf["rope_theta"]
    return _rope_params(hf).get("rope_theta", 10000.0)


def _rope_scaling(hf: Mapping[str, Any]) -> RopeScaling | None:
    rs = _rope_params(hf)
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: 'llama3')")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )
