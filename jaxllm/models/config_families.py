"""How the families beyond Llama spell their config.json, translated to ModelConfig's terms.

Owns: per architecture, the renaming of a family's own keys to the common ones that
`ModelConfig.from_hf_config` reads (GPT-2's n_embd, n_layer...; OPT's ffn_dim; Gemma 3's
nested text_config) and the family's flags (norm type, positional scheme, biases, attention
scaling, Gemma's norms, soft-caps and layer pattern, the experts of a mixture), with HF's
defaults for keys a config.json leaves out. Never imports jax and never reads files
(config.py's rules); an architecture not listed here passes through unchanged (the Llama
family).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

from jaxllm.models.config_keys import optional_int, read_float, read_rope_theta, required_int

# Architectures whose MLPs are mixtures of experts (models/moe.py).
_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# The Gemma family (models/gemma.py) and HF's defaults for what a config.json may leave out.
_GEMMA_DEFAULTS = {
    # architecture: (sliding-window layer period, attention softcap, final softcap)
    "GemmaForCausalLM": (None, None, None),
    "Gemma2ForCausalLM": (2, 50.0, 30.0),
    "Gemma3ForCausalLM": (6, None, None),
}
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's `layer_types` entries



def _opt(hf: Mapping[str, Any]) -> tuple[dict, dict]:
    hidden = hf.get("hidden_size", 768)
    if hf.get("layer_norm_elementwise_affine") is False:
        raise ValueError("OPT with layer_norm_elementwise_affine=false (LayerNorm without "
                         "weight and bias) is not supported")
    pre_norm = bool(hf.get("do_layer_norm_before", True))
    bias = bool(hf.get("enable_bias", True))
    proj = hf.get("word_embed_proj_dim")
    common = dict(hf, intermediate_size=hf.get("ffn_dim"), rms_norm_eps=1e-5,  # nn.LayerNorm's
                  hidden_act=hf.get("activation_function") or "relu",
                  tie_word_embeddings=hf.get("tie_word_embeddings", True),
                  attention_bias=bias)
    return common, dict(
        norm_type="layer", position_embedding="learned", learned_position_offset=2,
        do_layer_norm_before=pre_norm, mlp_bias=bias,
        word_embed_proj_dim=None if proj in (None, hidden) else proj,
        final_norm=pre_norm and not hf.get("_remove_final_layer_norm", False))


def _gpt2(hf: Mapping[str, Any]) -> tuple[dict, dict]:
    hidden = hf.get("n_embd", 768)
    common = dict(hf, hidden_size=hidden, num_hidden_layers=hf.get("n_layer", 12),
                  num_attention_heads=hf.get("n_head", 12),
                  max_position_embeddings=hf.get("n_positions", 1024),
                  intermediate_size=hf.get("n_inner") or 4 * hidden,
                  rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                  hidden_act=hf.get("activation_function") or "gelu_new",
                  tie_word_embeddings=hf.get("tie_word_embeddings", True),
                  attention_bias=True, num_key_value_heads=None, head_dim=None)
    if hf.get("add_cross_attention"):
        raise ValueError("GPT-2 with add_cross_attention=true (an encoder-decoder) is not "
                         "supported")
    return common, dict(
        norm_type="layer", position_embedding="learned", mlp_bias=True,
        attn_scale_by_head_dim=bool(hf.get("scale_attn_weights", True)),
        attn_scale_by_inverse_layer_idx=bool(hf.get("scale_attn_by_inverse_layer_idx", False)))


def _bert(hf: Mapping[str, Any]) -> tuple[dict, dict]:
    """BERT (models/bert.py): post-LayerNorm, learned absolute positions, token types,
    biases everywhere, GELU (erf)."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"config key 'position_embedding_type' is "
                         f"{hf['position_embedding_type']!r}; BERT supports 'absolute'")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ValueError("BERT as a decoder (is_decoder / add_cross_attention) is not supported")
    common = dict(hf, rms_norm_eps=read_float(hf, "layer_norm_eps", 1e-12),
                  hidden_act=hf.get("hidden_act") or "gelu", attention_bias=True,
                  max_position_embeddings=hf.get("max_position_embeddings", 512),
                  tie_word_embeddings=False)
    return common, dict(norm_type="layer", position_embedding="learned", mlp_bias=True,
                        o_proj_bias=True, do_layer_norm_before=False,
                        type_vocab_size=optional_int(hf, "type_vocab_size") or 2)


def _gemma(arch: str, hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict]:
    if arch == "Gemma3ForCausalLM" and isinstance(hf.get("text_config"), Mapping):
        # model_type "gemma3" (HF's multimodal config): the text model is in text_config.
        hf = {**{k: hf[k] for k in ("bos_token_id", "eos_token_id") if k in hf},
              **hf["text_config"]}
    # HF's default: tied for Gemma, untied for the Llama family; Gemma 3 norms q and k.
    fields = dict(tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                  qk_norm=arch == "Gemma3ForCausalLM")
    fields.update(_gemma_fields(arch, hf, required_int(hf, "num_hidden_layers")))
    return hf, fields


def _gemma_fields(arch: str, hf: Mapping[str, Any], num_layers: int) -> dict:
    """ModelConfig fields of a Gemma, Gemma 2 or Gemma 3 config.json (HF's defaults for keys
    it leaves out)."""
    period, attn_cap, final_cap = _GEMMA_DEFAULTS[arch]
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config key 'use_bidirectional_attention' is true: only causal "
                         "attention is supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act in ("gelu", "gelu_pytorch_tanh"):  # Gemma's "gelu" means the tanh form (HF too)
        act = "gelu_pytorch_tanh"
    else:
        raise ValueError(f"config key 'hidden_activation' is {act!r}; Gemma models support "
                         f"'gelu_pytorch_tanh'")
    fields: dict[str, Any] = {"hidden_act": act, "rms_norm_unit_offset": True}
    if period is None:  # Gemma (1): Llama's layout otherwise
        return fields
    layer_types = hf.get("layer_types")
    if layer_types is None:
        period = optional_int(hf, "sliding_window_pattern") or period
        layer_types = [FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers)]
    if not isinstance(layer_types, (list, tuple)):
        raise ValueError(f"config key 'layer_types' must be a list, got {layer_types!r}")
    rope = _gemma_rope(hf) if arch == "Gemma3ForCausalLM" else {"rope_theta": read_rope_theta(hf)}
    window = optional_int(hf, "sliding_window")
    fields.update(
        sandwich_norms=True,
        query_pre_attn_scalar=read_float(hf, "query_pre_attn_scalar", 256.0),
        # Gemma 3's config carries attn_logit_softcapping, but HF's and vLLM's Gemma 3 never
        # apply it: neither do we.
        attn_logit_softcapping=(read_float(hf, "attn_logit_softcapping", 0.0) or None
                                if arch == "Gemma2ForCausalLM" else None),
        final_logit_softcapping=(read_float(hf, "final_logit_softcapping", 0.0) or None
                                 if "final_logit_softcapping" in hf else final_cap),
        sliding_window=4096 if window is None else window,
        layer_types=tuple(layer_types),
        **rope)
    if attn_cap is not None and "attn_logit_softcapping" not in hf:
        fields["attn_logit_softcapping"] = attn_cap
    return fields


def _gemma_rope(hf: Mapping[str, Any]) -> dict:
    """Gemma 3's two RoPE bases: global layers' (rope_theta) and sliding layers'
    (rope_local_base_freq); transformers >= 5 nests them per layer type in rope_parameters."""
    params = hf.get("rope_parameters") or {}
    per_type = {}
    for layer_type, key, default in ((FULL, "rope_theta", 1_000_000.0),
                                     (SLIDING, "rope_local_base_freq", 10_000.0)):
        nested = params.get(layer_type) if isinstance(params, Mapping) else None
        if isinstance(nested, Mapping):
            kind = nested.get("rope_type") or nested.get("type")
            if kind not in (None, "default"):
                raise ValueError(f"rope_parameters[{layer_type!r}] type {kind!r} is not "
                                 f"supported for Gemma 3 (supported: 'default')")
            per_type[layer_type] = read_float(nested, "rope_theta", default, "rope_parameters")
        else:
            per_type[layer_type] = read_float(hf, key, default)
    if hf.get("rope_scaling"):
        raise ValueError(f"config key 'rope_scaling' ({hf['rope_scaling']!r}) is not "
                         f"supported for Gemma 3")
    return {"rope_theta": per_type[FULL], "rope_local_theta": per_type[SLIDING]}


def _moe_fields(arch: str, hf: Mapping[str, Any]) -> dict:
    """The mixture-of-experts fields of ModelConfig from an HF config (none for dense)."""
    if arch not in _MOE_ARCHITECTURES:
        return {}
    if arch == "MixtralForCausalLM":  # every layer sparse; intermediate_size is an expert's
        return dict(num_experts=required_int(hf, "num_local_experts"),
                    num_experts_per_tok=required_int(hf, "num_experts_per_tok"),
                    moe_intermediate_size=required_int(hf, "intermediate_size"))
    only = hf.get("mlp_only_layers") or ()
    if not isinstance(only, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"config key 'mlp_only_layers' must be a list of layer indices, "
                         f"got {only!r}")
    # Qwen's config.json says num_experts; transformers >= 5 writes num_local_experts.
    num_experts = optional_int(hf, "num_experts")
    return dict(num_experts=(required_int(hf, "num_local_experts") if num_experts is None
                             else num_experts),
                num_experts_per_tok=required_int(hf, "num_experts_per_tok"),
                moe_intermediate_size=required_int(hf, "moe_intermediate_size"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=(
                    required_int(hf, "shared_expert_intermediate_size")
                    if arch == "Qwen2MoeForCausalLM" else 0),
                decoder_sparse_step=optional_int(hf, "decoder_sparse_step") or 1,
                mlp_only_layers=tuple(only))


_FAMILIES: dict[str, Callable[[Mapping[str, Any]], tuple[Mapping[str, Any], dict]]] = {
    "OPTForCausalLM": _opt,
    "GPT2LMHeadModel": _gpt2,
    "BertModel": _bert,
    "BertForSequenceClassification": _bert,
    **{arch: functools.partial(_gemma, arch) for arch in _GEMMA_DEFAULTS},
    **{arch: lambda hf, arch=arch: (hf, _moe_fields(arch, hf)) for arch in _MOE_ARCHITECTURES},
}


def family_fields(arch: str, hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict]:
    """-> (the config with the common keys filled in, extra ModelConfig fields)."""
    translate = _FAMILIES.get(arch)
    return (hf, {}) if translate is None else translate(hf)
