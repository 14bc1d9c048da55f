"""ModelConfig: the architecture facts a jaxllm model needs, built once from an HF config.

Owns: translating `config.json` (or GGUF metadata turned into the same dict) into a frozen,
validated dataclass, including the choice of architecture (`architectures[0]`, or the
`model_type` fallback HF's Auto classes use when `architectures` is absent). Never imports jax:
the scheduler and the loader read it too. Never reads files: errors name keys, and the caller
that opened the file adds its path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxllm.models.config_families import FULL, SLIDING, family_fields
from jaxllm.models.config_keys import (optional_int, read_float, read_rope_params,
                                       read_rope_theta, required_int)

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
    "opt": "OPTForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # the text model of a config that nests a text_config
}

@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3's LongRoPE (`rope_type` "longrope", formerly "su"): per-frequency divisors,
    `short_factor` within the pretraining length and `long_factor` beyond it, and cos/sin
    multiplied by `attention_factor` (HF's name; vLLM's short/long mscale)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


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
    rope_scaling: RopeScaling | LongRopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always for Qwen2)
    o_proj_bias: bool = False  # bias on o_proj too (Llama/Mistral/Qwen3 `attention_bias`)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # Families beyond Llama (OPT, GPT-2, Phi-3; models/config_families.py reads their keys).
    # Flags, not classes: the defaults are Llama's.
    hidden_act: str = "silu"  # models/layers.py ACTIVATIONS
    norm_type: str = "rms"  # "rms" | "layer" (LayerNorm with bias; eps = rms_norm_eps)
    position_embedding: str = "rope"  # "rope" | "learned" (a table, positions + offset)
    learned_position_offset: int = 0  # OPT's table starts 2 rows in
    do_layer_norm_before: bool = True  # False: post-norm (OPT-350m)
    mlp_bias: bool = False  # fc1/fc2 bias (OPT `enable_bias`, GPT-2)
    word_embed_proj_dim: int | None = None  # OPT: embeddings narrower than hidden_size
    final_norm: bool = True  # OPT post-norm has no final LayerNorm
    attn_scale_by_head_dim: bool = True  # GPT-2 `scale_attn_weights`
    attn_scale_by_inverse_layer_idx: bool = False  # GPT-2: scores / (layer index + 1)
    partial_rotary_factor: float = 1.0  # rotate the first head_dim * factor dims only
    # Gemma family (models/gemma.py); the defaults leave Llama as it is.
    rms_norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP
    query_pre_attn_scalar: float | None = None  # attention scale scalar ** -0.5 (else head_dim)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores c * tanh(s / c)
    final_logit_softcapping: float | None = None  # Gemma 2/3: logits c * tanh(l / c)
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL (sliding_window's layers);
    # () with a sliding_window: every layer is SLIDING
    rope_local_theta: float | None = None  # RoPE base of the SLIDING layers (Gemma 3)
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
    # Attention options. sliding_window: a query at position p sees keys (p - W, p] (HF's
    # `sliding_window` where `use_sliding_window` does not turn it off: Mistral v0.1's 4096);
    # in the Llama family every layer uses it (a family with a per-layer pattern applies it to
    # its sliding layers). None: full causal attention.
    sliding_window: int | None = None
    # Pooling models (jaxllm/pooling/): BERT's token-type table, a classifier's output rows.
    type_vocab_size: int = 0
    num_labels: int = 0

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
        if self.norm_type not in ("rms", "layer"):
            raise ValueError(f"norm_type must be 'rms' or 'layer', got {self.norm_type!r}")
        if self.position_embedding not in ("rope", "learned"):
            raise ValueError(f"position_embedding must be 'rope' or 'learned', got "
                             f"{self.position_embedding!r}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got "
                             f"{self.partial_rotary_factor}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers or
                                 not set(self.layer_types) <= {SLIDING, FULL}):
            raise ValueError(f"layer_types must name {self.num_hidden_layers} layers, each "
                             f"{SLIDING!r} or {FULL!r}; got {list(self.layer_types)}")

    @property
    def num_embeddings(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == SLIDING

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer `layer` (None: it attends to the whole context)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(RoPE base, scaling) of layer `layer`: Gemma 3's sliding layers have their own
        base, and no scaling."""
        if self.rope_local_theta is not None and self.is_sliding(layer):
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a `config.json` dict (or a transformers PretrainedConfig.to_dict()).

        Raises ValueError naming the key for anything missing, null where a value is needed,
        or of the wrong type; never KeyError or TypeError."""
        if not isinstance(hf, Mapping):
            raise ValueError(f"a model config must be a JSON object, got {type(hf).__name__}")
        arch = architecture_of(hf)
        hf, family = family_fields(arch, hf)
        num_heads = required_int(hf, "num_attention_heads")
        hidden = required_int(hf, "hidden_size")
        # max(.., 1): a zero head count is reported by __post_init__ by name, not as a
        # ZeroDivisionError here.
        head_dim = optional_int(hf, "head_dim") or hidden // max(num_heads, 1)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        max_pos = optional_int(hf, "max_position_embeddings")
        max_pos = 2048 if max_pos is None else max_pos
        # Gemma 3's per-layer-type RoPE bases are read by config_families.py; LongRoPE reads the
        # unclamped length.
        rope_scaling = None if arch == "Gemma3ForCausalLM" else _rope_scaling(hf, max_pos)
        fields = dict(
            architecture=arch,
            vocab_size=required_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=required_int(hf, "intermediate_size"),
            num_hidden_layers=required_int(hf, "num_hidden_layers"),
            num_attention_heads=num_heads,
            # 0 or null means "absent", as in transformers: plain multi-head attention.
            num_key_value_heads=optional_int(hf, "num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=read_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=read_rope_theta(hf),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=_qkv_bias(arch, hf),
            o_proj_bias=arch not in _QKV_ONLY_BIAS and bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
            hidden_act=hf.get("hidden_act") or "silu",
            partial_rotary_factor=read_float(hf, "partial_rotary_factor", 0.0) or read_float(
                read_rope_params(hf), "partial_rotary_factor", 1.0, where="rope_parameters"),
            sliding_window=_sliding_window(hf),
        )
        # A family's own fields override the common reading above (models/config_families.py).
        fields.update(family)
        return cls(**fields)


# Qwen2 and Qwen2-MoE put a bias on q/k/v only (Qwen2 always, Qwen2-MoE per `qkv_bias`).
_QKV_ONLY_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


def _qkv_bias(arch: str, hf: Mapping[str, Any]) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    """HF's window where every layer uses it, else None (Mistral v0.1: 4096; later Mistrals
    and most Qwen2 configs: none). `use_sliding_window: false` turns it off (Qwen2/Qwen3); there
    layers from `max_window_layers` on use it, as in transformers: all of them or none is
    supported, a mix is a ValueError (as in vLLM)."""
    window = optional_int(hf, "sliding_window")
    if not window or not hf.get("use_sliding_window", True):
        return None
    max_window_layers = optional_int(hf, "max_window_layers")
    if max_window_layers is None or max_window_layers <= 0:
        return window
    num_layers = required_int(hf, "num_hidden_layers")
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


def _rope_scaling(hf: Mapping[str, Any], max_pos: int
                  ) -> RopeScaling | LongRopeScaling | None:
    rs = read_rope_params(hf)
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind in ("longrope", "su"):
        return _long_rope(hf, rs, max_pos)
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: 'llama3', "
                         f"'longrope', 'su')")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if rs.get(k) is None]
    if missing:
        raise ValueError(f"llama3 rope scaling needs {', '.join(missing)} in "
                         f"rope_parameters / rope_scaling")
    return RopeScaling(
        factor=read_float(rs, "factor", 0.0, where="rope_scaling"),
        low_freq_factor=read_float(rs, "low_freq_factor", 0.0, where="rope_scaling"),
        high_freq_factor=read_float(rs, "high_freq_factor", 0.0, where="rope_scaling"),
        original_max_position_embeddings=required_int(rs, "original_max_position_embeddings"),
    )


def _long_rope(hf: Mapping[str, Any], rs: Mapping[str, Any], max_pos: int) -> LongRopeScaling:
    """LongRoPE as HF computes it: attention_factor when given, else from the context
    extension factor (`factor`, else max_position_embeddings / original length)."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = rs.get(key)
        if not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in value):
            raise ValueError(f"longrope scaling needs {key!r}, a list of numbers, in "
                             f"rope_parameters / rope_scaling; got {value!r}")
        factors[key] = tuple(float(f) for f in value)
    original = optional_int(rs, "original_max_position_embeddings") or optional_int(
        hf, "original_max_position_embeddings")
    if original is None:
        raise ValueError("longrope scaling needs original_max_position_embeddings (in the "
                         "config or in rope_parameters / rope_scaling)")
    factor = read_float(rs, "factor", 0.0, where="rope_scaling") or max_pos / original
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(factors["short_factor"], factors["long_factor"], original,
                           read_float({"attention_factor": attention}, "attention_factor", 1.0,
                                  where="rope_scaling"))
