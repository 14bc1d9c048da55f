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
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# Architectures whose MLPs are mixtures of experts (models/moe.py), and what they read.
_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

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
    # Mixture of experts (models/moe.py). num_experts == 0: every layer has a dense MLP.
    # A layer i is sparse unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step
    # (Qwen-MoE's rule); its experts are SwiGLU MLPs of width moe_intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the chosen k probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on, sigmoid-gated expert
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size ({self.padded_vocab_size}) must be >= "
                             f"vocab_size ({self.vocab_size})")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts="
                             f"{self.num_experts}], got {self.num_experts_per_tok}")
        if self.num_experts and (self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1):
            raise ValueError(f"moe_intermediate_size and decoder_sparse_step must be >= 1, "
                             f"got {self.moe_intermediate_size}, {self.decoder_sparse_step}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def num_embeddings(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

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
        if hf.get("sliding_window") and hf.get("use_sliding_window", True) and \
                arch in ("MistralForCausalLM",) + _MOE_ARCHITECTURES:
            # Mistral v0.1 uses a 4096-token window; later Mistrals set it to null. We only
            # implement full attention, so limit the context to the window instead of
            # silently computing something else.
            max_pos = min(max_pos, _required_int(hf, "sliding_window"))
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
            attention_bias=_qkv_bias(arch, hf),
            o_proj_bias=arch not in _QKV_ONLY_BIAS and bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
            **_moe_fields(arch, hf),
        )


# Qwen2 and Qwen2-MoE put a bias on q/k/v only (Qwen2 always, Qwen2-MoE per `qkv_bias`).
_QKV_ONLY_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


def _qkv_bias(arch: str, hf: Mapping[str, Any]) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def _moe_fields(arch: str, hf: Mapping[str, Any]) -> dict:
    """The mixture-of-experts fields of ModelConfig from an HF config (none for dense)."""
    if arch not in _MOE_ARCHITECTURES:
        return {}
    if arch == "MixtralForCausalLM":  # every layer sparse; intermediate_size is an expert's
        return dict(num_experts=_required_int(hf, "num_local_experts"),
                    num_experts_per_tok=_required_int(hf, "num_experts_per_tok"),
                    moe_intermediate_size=_required_int(hf, "intermediate_size"))
    only = hf.get("mlp_only_layers") or ()
    if not isinstance(only, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"config key 'mlp_only_layers' must be a list of layer indices, "
                         f"got {only!r}")
    # Qwen's config.json says num_experts; transformers >= 5 writes num_local_experts.
    num_experts = _optional_int(hf, "num_experts")
    return dict(num_experts=(_required_int(hf, "num_local_experts") if num_experts is None
                             else num_experts),
                num_experts_per_tok=_required_int(hf, "num_experts_per_tok"),
                moe_intermediate_size=_required_int(hf, "moe_intermediate_size"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=(
                    _required_int(hf, "shared_expert_intermediate_size")
                    if arch == "Qwen2MoeForCausalLM" else 0),
                decoder_sparse_step=_optional_int(hf, "decoder_sparse_step") or 1,
                mlp_only_layers=tuple(only))


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
