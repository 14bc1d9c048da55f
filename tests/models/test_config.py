"""ModelConfig.from_hf_config on config.json dicts of every architecture, both transformers
key layouts (`rope_parameters` in 5.x, `rope_theta` + `rope_scaling` before), the `model_type`
fallback when `architectures` is absent, and its errors (each naming the key at fault)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxllm.models.config import MODEL_TYPE_ARCHITECTURES, ModelConfig, RopeScaling
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


_FALLBACK = [("llama", "LlamaForCausalLM", False, False),
             ("mistral", "MistralForCausalLM", False, False),
             ("qwen2", "Qwen2ForCausalLM", True, False),
             ("qwen3", "Qwen3ForCausalLM", False, True)]


@pytest.mark.parametrize("absent", ["missing", "null", "empty"])
@pytest.mark.parametrize("model_type, arch, bias, qk_norm", _FALLBACK)
def test_model_type_picks_the_architecture_when_architectures_is_absent(
        model_type, arch, bias, qk_norm, absent):
    d = hf_dict(model_type=model_type)
    if absent == "missing":
        del d["architectures"]
    else:
        d["architectures"] = None if absent == "null" else []
    cfg = ModelConfig.from_hf_config(d)
    assert cfg == ModelConfig.from_hf_config(hf_dict(arch, model_type=model_type))
    assert (cfg.architecture, cfg.attention_bias, cfg.qk_norm) == (arch, bias, qk_norm)


def test_model_type_fallback_covers_exactly_the_registry():
    from jaxllm.models.registry import supported_architectures

    assert sorted(MODEL_TYPE_ARCHITECTURES) == ["llama", "mistral", "mixtral", "qwen2",
                                                 "qwen2_moe", "qwen3", "qwen3_moe"]
    assert sorted(MODEL_TYPE_ARCHITECTURES.values()) == supported_architectures()


def test_mistral_fallback_keeps_the_sliding_window_cap():
    d = hf_dict(architectures=None, model_type="mistral", max_position_embeddings=32768,
                sliding_window=4096)
    assert ModelConfig.from_hf_config(d).max_position_embeddings == 4096


def test_architectures_wins_over_model_type():
    cfg = ModelConfig.from_hf_config(hf_dict("Qwen2ForCausalLM", model_type="llama"))
    assert (cfg.architecture, cfg.attention_bias) == ("Qwen2ForCausalLM", True)


_NO_CLASS = ("cannot pick a model class: config key 'architectures' is missing or empty and "
             "'model_type' {}; set 'architectures' or use a supported 'model_type': "
             "'llama' (LlamaForCausalLM), 'mistral' (MistralForCausalLM), "
             "'mixtral' (MixtralForCausalLM), 'qwen2' (Qwen2ForCausalLM), "
             "'qwen2_moe' (Qwen2MoeForCausalLM), 'qwen3' (Qwen3ForCausalLM), "
             "'qwen3_moe' (Qwen3MoeForCausalLM)")


@pytest.mark.parametrize("model_type, found", [
    (None, "is missing"), ("gpt2", "is 'gpt2'"), ("Llama", "is 'Llama'"), (7, "is 7")])
def test_no_architectures_and_unknown_model_type(model_type, found):
    d = hf_dict(architectures=None)
    if model_type is not None:
        d["model_type"] = model_type
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(d)
    assert str(err.value) == _NO_CLASS.format(found)


@pytest.mark.parametrize("archs", ["LlamaForCausalLM", [None], {"a": 1}])
def test_architectures_of_the_wrong_type(archs):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(hf_dict(architectures=archs))
    assert str(err.value) == ("config key 'architectures' must be a list of class names such "
                              f'as ["LlamaForCausalLM"], got {archs!r}')


@pytest.mark.parametrize("config", [[1, 2], "llama", None])
def test_config_that_is_not_an_object(config):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(config)
    assert str(err.value) == (f"a model config must be a JSON object, got "
                              f"{type(config).__name__}")


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads"])
@pytest.mark.parametrize("state", ["missing", "null"])
def test_missing_required_key_is_named(key, state):
    d = hf_dict()
    if state == "missing":
        del d[key]
    else:
        d[key] = None
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(d)
    assert str(err.value) == f"config key {key!r} (an integer) is required but is {state}"


@pytest.mark.parametrize("key, value", [("hidden_size", "64"), ("hidden_size", 64.5),
                                        ("num_hidden_layers", True), ("head_dim", [8]),
                                        ("max_position_embeddings", "4k")])
def test_non_integer_size_is_named(key, value):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(hf_dict(**{key: value}))
    assert str(err.value) == f"config key {key!r} must be an integer, got {value!r}"


def test_integral_floats_are_accepted():
    assert ModelConfig.from_hf_config(hf_dict(hidden_size=64.0)).hidden_size == 64


@pytest.mark.parametrize("key, value", [("rms_norm_eps", "1e-5"), ("rope_theta", False)])
def test_non_numeric_float_is_named(key, value):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(hf_dict(**{key: value}))
    assert str(err.value) == f"config key {key!r} must be a number, got {value!r}"


def test_rope_parameters_that_are_not_an_object():
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(hf_dict(rope_parameters="llama3"))
    assert str(err.value) == "config key 'rope_parameters' must be an object, got 'llama3'"


def test_llama3_rope_with_missing_keys():
    d = hf_dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0))
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(d)
    assert str(err.value) == ("llama3 rope scaling needs low_freq_factor, high_freq_factor, "
                              "original_max_position_embeddings in rope_parameters / "
                              "rope_scaling")


# num_key_value_heads 0 means "absent" (falls back to num_attention_heads), hence -2.
@pytest.mark.parametrize("field, value", [("hidden_size", 0), ("vocab_size", 0),
                                          ("num_key_value_heads", -2),
                                          ("num_attention_heads", 0),
                                          ("max_position_embeddings", 0)])
def test_nonpositive_sizes(field, value):
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        ModelConfig.from_hf_config(hf_dict(**{field: value}))


def test_frozen():
    cfg = ModelConfig.from_hf_config(hf_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1
