"""ModelConfig.from_hf_config on config.json dicts of every architecture, both transformers
key layouts (`rope_parameters` in 5.x, `rope_theta` + `rope_scaling` before), and its errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxllm.models.config import ModelConfig, RopeScaling
from jaxllm.models.layers import rope_inv_freq

LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)


def hf_dict(arch="LlamaForCausalLM", **overrides):
    d = dict(architectures=[arch], vocab_size=1000, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    d.update(overrides)
    return d


def test_llama_fields_and_defaults():
    cfg = ModelConfig.from_hf_config(hf_dict(rms_norm_eps=1e-5, max_position_embeddings=4096,
                                             bos_token_id=1, eos_token_id=2))
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "LlamaForCausalLM", 1000, 64, 128)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 8, 2)
    assert cfg.head_dim == 64 // 8 and cfg.num_queries_per_kv == 4
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e-5, 4096)
    assert (cfg.rope_theta, cfg.rope_scaling) == (10000.0, None)
    assert not (cfg.tie_word_embeddings or cfg.attention_bias or cfg.qk_norm)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, (2,))


def test_head_dim_explicit_or_derived():
    assert ModelConfig.from_hf_config(hf_dict(hidden_size=60, num_attention_heads=6)).head_dim == 10
    assert ModelConfig.from_hf_config(hf_dict(head_dim=None)).head_dim == 8
    # Qwen3 / Mistral-Nemo style: head_dim is not hidden_size / num_heads.
    assert ModelConfig.from_hf_config(hf_dict("Qwen3ForCausalLM", head_dim=128)).head_dim == 128


def test_kv_heads_default_to_query_heads():
    d = hf_dict()
    del d["num_key_value_heads"]
    assert ModelConfig.from_hf_config(d).num_key_value_heads == 8


@pytest.mark.parametrize("arch, bias, qk_norm", [
    ("LlamaForCausalLM", False, False), ("MistralForCausalLM", False, False),
    ("Qwen2ForCausalLM", True, False), ("Qwen3ForCausalLM", False, True)])
def test_architecture_flags(arch, bias, qk_norm):
    cfg = ModelConfig.from_hf_config(hf_dict(arch))
    assert (cfg.architecture, cfg.attention_bias, cfg.qk_norm) == (arch, bias, qk_norm)


@pytest.mark.parametrize("config_cls, arch", [
    ("LlamaConfig", "LlamaForCausalLM"), ("MistralConfig", "MistralForCausalLM"),
    ("Qwen2Config", "Qwen2ForCausalLM"), ("Qwen3Config", "Qwen3ForCausalLM")])
def test_transformers_config_to_dict(config_cls, arch):
    hf = getattr(transformers, config_cls)(
        vocab_size=300, hidden_size=96, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=3, head_dim=16, rope_theta=123456.0,
        tie_word_embeddings=True, max_position_embeddings=512)
    hf.architectures = [arch]
    cfg = ModelConfig.from_hf_config(hf.to_dict())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (
        300, 96, 3, 16)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (6, 3)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.tie_word_embeddings) == (123456.0, None, True)
    assert cfg.max_position_embeddings == 512
    assert cfg.attention_bias == (arch == "Qwen2ForCausalLM")
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM")


@pytest.mark.parametrize("eos, want", [(2, (2,)), ([128001, 128009], (128001, 128009)),
                                       (None, ())])
def test_eos_int_list_or_none(eos, want):
    assert ModelConfig.from_hf_config(hf_dict(eos_token_id=eos)).eos_token_id == want


def test_mistral_sliding_window_caps_context():
    d = hf_dict("MistralForCausalLM", max_position_embeddings=32768, sliding_window=4096)
    assert ModelConfig.from_hf_config(d).max_position_embeddings == 4096
    d["sliding_window"] = None
    assert ModelConfig.from_hf_config(d).max_position_embeddings == 32768


_LLAMA3_LAYOUTS = {
    "transformers5": dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                               **LLAMA3_ROPE)),
    "transformers4": dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3",
                                                                 **LLAMA3_ROPE)),
    "legacy_type_key": dict(rope_theta=500000.0, rope_scaling=dict(type="llama3",
                                                                   **LLAMA3_ROPE)),
}


@pytest.mark.parametrize("layout", sorted(_LLAMA3_LAYOUTS))
def test_llama3_rope_keys(layout):
    cfg = ModelConfig.from_hf_config(hf_dict(**_LLAMA3_LAYOUTS[layout]))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(**LLAMA3_ROPE)


@pytest.mark.parametrize("extra", [
    dict(rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    dict(rope_theta=1e6, rope_scaling=None),
    dict(rope_theta=1e6)], ids=["transformers5", "transformers4_null_scaling", "theta_only"])
def test_default_rope_keys(extra):
    cfg = ModelConfig.from_hf_config(hf_dict(**extra))
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, None)


@pytest.mark.parametrize("head_dim, theta, rope", [
    (16, 500000.0, dict(LLAMA3_ROPE, original_max_position_embeddings=64)),  # all 3 regimes
    (128, 500000.0, LLAMA3_ROPE),                                           # Llama 3.1 8B
    (64, 500000.0, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)),            # Llama 3.2 1B
], ids=["tiny", "llama3.1", "llama3.2"])
def test_llama3_inv_freq_matches_transformers(head_dim, theta, rope):
    hf = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                  head_dim=head_dim, max_position_embeddings=131072,
                                  rope_parameters=dict(
                                      rope_type="llama3", rope_theta=theta, **rope))
    hf.architectures = ["LlamaForCausalLM"]
    cfg = ModelConfig.from_hf_config(hf.to_dict())
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert attention_factor == 1.0
    got = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)
    # The scaling must actually change something, or this compares default RoPE twice.
    assert not np.allclose(got, rope_inv_freq(head_dim, theta, None))


def test_default_inv_freq():
    got = rope_inv_freq(10, 10000.0, None)
    want = 1.0 / 10000.0 ** (np.arange(0, 10, 2) / 10)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*num_key_value_heads \(4\)"):
        ModelConfig.from_hf_config(hf_dict(hidden_size=60, num_attention_heads=6,
                                           num_key_value_heads=4))


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic", "longrope"])
def test_unsupported_rope_type(rope_type):
    d = hf_dict(rope_parameters=dict(rope_type=rope_type, rope_theta=1e4, factor=4.0))
    with pytest.raises(ValueError, match=f"'{rope_type}'.*llama3"):
        ModelConfig.from_hf_config(d)


def test_missing_architectures():
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_hf_config(hf_dict(architectures=None))


# num_key_value_heads 0 means "absent" (falls back to num_attention_heads), hence -2.
@pytest.mark.parametrize("field, value", [("hidden_size", 0), ("vocab_size", 0),
                                          ("num_key_value_heads", -2)])
def test_nonpositive_sizes(field, value):
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        ModelConfig.from_hf_config(hf_dict(**{field: value}))


def test_frozen():
    cfg = ModelConfig.from_hf_config(hf_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1
