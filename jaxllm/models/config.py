"""ModelConfig: the architecture facts a jaxllm model needs, built once from an HF config.

Owns: translating `config.json` (or GGUF metadata turned into the same dict) into a frozen,
validated dataclass, including the choice of architecture (`architectures[0]`, or the
`model_type` fallback HF's Auto classes use when `architectures` is absent). Never imports jax:
the scheduler and the loader read it too. Never reads files: errors name keys, and the caller
that opened the file adds its path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# config.json `model_type` -> the architecture HF's AutoModelForCausalLM builds for it; used
# only when `architectures` is missing or null (configs written by hand or by old tools).
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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
    # Rows of the embedding and the LM head when tensor parallelism pads the vocabulary to
    # a multiple of its size (models/tp_layout.py); None: vocab_size. Logits keep vocab_size.
    padded_vocab_size: int | None = None
    # Attention options. sliding_window: a query at position p sees keys (p - W, p] (HF's
    # `sliding_window` where `use_sliding_window` does not turn it off: Mistral v0.1's 4096);
    # in the Llama family every layer uses it (a family with a per-layer pattern applies it to
    # its sliding layers). None: full causal attention.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size ({self.padded_vocab_size}) must be >= "
                             f"vocab_size ({self.vocab_size})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def num_embeddings(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a `config.json` dict (or a transformers PretrainedConfig.to_dict()).

        Raises ValueError naming the key for anything missing, null where a value is needed,
        or of the wrong type; never KeyError or TypeError."""
        if not isinstance(hf, Mapping):
            raise ValueError(f"a model config must be a JSON object, got {type(hf).__name__}")
        arch = architecture_of(hf)
        num_heads = _required_int(hf, "num_attention_heads")
        hidden = _required_int(hf, "hidden_size")
        # max(.., 1): a zero head count is reported by __post_init__ by name, not as a
        # ZeroDivisionError here.
        head_dim = _optional_int(hf, "head_dim") or hidden // max(num_heads, 1)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        max_pos = _optional_int(hf, "max_position_embeddings")
        max_pos = 2048 if max_pos is None else max_pos
        return cls(
            architecture=arch,
            vocab_size=_required_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(hf, "intermediate_size"),
            num_hidden_layers=_required_int(hf, "num_hidden_layers"),
            num_attention_heads=num_heads,
            # 0 or null means "absent", as in transformers: plain multi-head attention.
            num_key_value_heads=_optional_int(hf, "num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
            sliding_window=_sliding_window(hf),
        )


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    """HF's window where every layer uses it, else None (Mistral v0.1: 4096; later Mistrals
    and most Qwen2 configs: none). `use_sliding_window: false` turns it off (Qwen2/Qwen3); there
    layers from `max_window_layers` on use it, as in transformers: all of them or none is
    supported, a mix is a ValueError (as in vLLM)."""
    window = _optional_int(hf, "sliding_window")
    if not window or not hf.get("use_sliding_window", True):
        return None
    max_window_layers = _optional_int(hf, "max_window_layers")
    if max_window_layers is None or max_window_layers <= 0:
        return window
    num_layers = _required_int(hf, "num_hidden_layers")
    if max_window_layers >= num_layers:
        return None  # transformers windows layers i >= max_window_layers: none here
    raise ValueError(f"use_sliding_window with max_window_layers={max_window_layers} < "
                     f"num_hidden_layers={num_layers} (a window on some layers only) is not "
                     f"supported; set max_window_layers to 0 (every layer) or "
                     f"{num_layers} (none)")


def architecture_of(hf: Mapping[str, Any]) -> str:
    """`architectures[0]`; when that key is missing, null or empty, what `model_type` maps to.

    A named but unsupported architecture is left for the model registry to reject (it knows
    the classes); only the fallback is decided here.
    """
    archs = hf.get("architectures")
    if archs:
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ValueError(f"config key 'architectures' must be a list of class names "
                             f"such as [\"LlamaForCausalLM\"], got {archs!r}")
        return archs[0]
    model_type = hf.get("model_type")
    if isinstance(model_type, str) and model_type in MODEL_TYPE_ARCHITECTURES:
        return MODEL_TYPE_ARCHITECTURES[model_type]
    found = "is missing" if model_type is None else f"is {model_type!r}"
    supported = ", ".join(f"{t!r} ({a})" for t, a in sorted(MODEL_TYPE_ARCHITECTURES.items()))
    raise ValueError(
        f"cannot pick a model class: config key 'architectures' is missing or empty and "
        f"'model_type' {found}; set 'architectures' or use a supported 'model_type': "
        f"{supported}")


def _optional_int(hf: Mapping[str, Any], key: str) -> int | None:
    """hf[key] as an int, None when absent or null. 12.0 is accepted; 12.5, "12", true are not."""
    value = hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"config key {key!r} must be an integer, got {value!r}")
    return int(value)


def _required_int(hf: Mapping[str, Any], key: str) -> int:
    value = _optional_int(hf, key)
    if value is None:
        state = "null" if key in hf else "missing"
        raise ValueError(f"config key {key!r} (an integer) is required but is {state}")
    return value


def _float(hf: Mapping[str, Any], key: str, default: float, where: str = "config") -> float:
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} key {key!r} must be a number, got {value!r}")
    return float(value)


def _rope_params(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`.
    for key in ("rope_parameters", "rope_scaling"):
        value = hf.get(key)
        if value:
            if not isinstance(value, Mapping):
                raise ValueError(f"config key {key!r} must be an object, got {value!r}")
            return value
    return {}


def _rope_theta(hf: Mapping[str, Any]) -> float:
    if hf.get("rope_theta") is not None:
        return _float(hf, "rope_theta", 10000.0)
    return _float(_rope_params(hf), "rope_theta", 10000.0, where="rope_parameters")


def _rope_scaling(hf: Mapping[str, Any]) -> RopeScaling | None:
    rs = _rope_params(hf)
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: 'llama3')")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if rs.get(k) is None]
    if missing:
        raise ValueError(f"llama3 rope scaling needs {', '.join(missing)} in "
                         f"rope_parameters / rope_scaling")
    return RopeScaling(
        factor=_float(rs, "factor", 0.0, where="rope_scaling"),
        low_freq_factor=_float(rs, "low_freq_factor", 0.0, where="rope_scaling"),
        high_freq_factor=_float(rs, "high_freq_factor", 0.0, where="rope_scaling"),
        original_max_position_embeddings=_required_int(rs, "original_max_position_embeddings"),
    )
