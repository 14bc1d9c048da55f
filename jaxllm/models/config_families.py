"""How the families beyond Llama spell their config.json, translated to ModelConfig's terms.

Owns: per architecture, the renaming of a family's own keys to the common ones that
`ModelConfig.from_hf_config` reads (GPT-2's n_embd, n_layer...; OPT's ffn_dim) and the
family's flags (norm type, positional scheme, biases, attention scaling), with HF's defaults
for keys a config.json leaves out. Never imports jax and never reads files (config.py's rules);
an architecture not listed here passes through unchanged (the Llama family).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping


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


_FAMILIES: dict[str, Callable[[Mapping[str, Any]], tuple[dict, dict]]] = {
    "OPTForCausalLM": _opt,
    "GPT2LMHeadModel": _gpt2,
}


def family_fields(arch: str, hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict]:
    """-> (the config with the common keys filled in, extra ModelConfig fields)."""
    translate = _FAMILIES.get(arch)
    return (hf, {}) if translate is None else translate(hf)
