"""A config.json without `architectures` (missing or null) loads by its `model_type`, as HF's
Auto classes do, and gives exactly the logits of the same directory with `architectures` set.

Each model type gets one tiny random HF model written three times (architectures set, key
deleted, key null) into directories that differ only in config.json."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (SUPPORTED_MODEL_TYPES, hf_logits, hf_numpy_state, prefill_logits,
                     tiny_hf_model)

from jaxllm.models.safetensors_io import save_file
from jaxllm.models.weights import load_hf_dir

TOKENS = [3, 17, 42, 5, 77, 1, 0, 63, 64]
_SIZES = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=128)
CASES = [("llama", "LlamaConfig", "LlamaForCausalLM"),
         ("mistral", "MistralConfig", "MistralForCausalLM"),
         ("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),     # q/k/v biases
         ("qwen3", "Qwen3Config", "Qwen3ForCausalLM")]     # q/k norms


def _write_dir(path, hf_config: dict, state: dict) -> str:
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config))
    return str(path)


@pytest.mark.parametrize("model_type, config_cls, arch", CASES, ids=[c[0] for c in CASES])
def test_no_architectures_loads_by_model_type(model_type, config_cls, arch, tmp_path):
    hf_model = tiny_hf_model(config_cls, arch, seed=5, **_SIZES)
    state = hf_numpy_state(hf_model)
    with_arch = hf_model.config.to_dict()
    assert (with_arch["architectures"], with_arch["model_type"]) == ([arch], model_type)
    missing = {k: v for k, v in with_arch.items() if k != "architectures"}
    null = {**with_arch, "architectures": None}

    logits = {}
    for name, hf_config in [("set", with_arch), ("missing", missing), ("null", null)]:
        model, cfg, _ = load_hf_dir(_write_dir(tmp_path / name, hf_config, state), jnp.float32)
        assert cfg.architecture == arch, name
        logits[name] = prefill_logits(model, cfg, TOKENS)

    np.testing.assert_array_equal(logits["missing"], logits["set"])
    np.testing.assert_array_equal(logits["null"], logits["set"])
    # ... and "set" is right, so the three are not equally wrong.
    assert np.abs(logits["set"] - hf_logits(hf_model, TOKENS)).max() <= 1e-4


def test_unknown_model_type_without_architectures_names_the_file(tmp_path):
    hf_model = tiny_hf_model("LlamaConfig", "LlamaForCausalLM", seed=5, **_SIZES)
    hf_config = {**hf_model.config.to_dict(), "model_type": "bloom"}
    del hf_config["architectures"]
    model_dir = _write_dir(tmp_path / "bloom", hf_config, hf_numpy_state(hf_model))
    with pytest.raises(ValueError) as err:
        load_hf_dir(model_dir, jnp.float32)
    assert str(err.value) == (
        f"{model_dir}/config.json: cannot pick a model class: config key 'architectures' is "
        f"missing or empty and 'model_type' is 'bloom'; set 'architectures' or use a "
        f"supported 'model_type': {SUPPORTED_MODEL_TYPES}")
