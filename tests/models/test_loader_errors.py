"""Checkpoint loading: every mismatch is a clear error naming the tensor, the architecture or
the path; a sharded HF directory (float32 or bfloat16 safetensors) round-trips to HF logits."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import hf_logits, hf_numpy_state, prefill_logits, tiny_hf_model

from jaxllm.models.config import ModelConfig
from jaxllm.models.registry import supported_architectures
from jaxllm.models.safetensors_io import save_file
from jaxllm.models.weights import load_hf_dir, load_params

TOKENS = [3, 17, 42, 5, 77, 1, 0, 63, 64, 12, 9]   # 11 tokens: crosses two 4-token blocks


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model("LlamaConfig", "LlamaForCausalLM", seed=3, vocab_size=80,
                         hidden_size=60, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                         max_position_embeddings=128)


@pytest.fixture(scope="module")
def cfg(hf_model):
    return ModelConfig.from_hf_config(hf_model.config.to_dict())


@pytest.fixture()
def state(hf_model):
    return hf_numpy_state(hf_model)


def _load(cfg, state):
    return load_params(cfg, state.items(), jnp.float32)


def test_missing_tensor_is_named(cfg, state):
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\."):
        _load(cfg, state)


def test_unexpected_tensor_is_named(cfg, state):
    state["model.layers.0.self_attn.o_proj.bias"] = np.zeros(60, np.float32)
    with pytest.raises(ValueError,
                       match=r"unexpected tensors: model\.layers\.0\.self_attn\.o_proj\.bias"):
        _load(cfg, state)


def test_wrong_shape_names_tensor_and_both_shapes(cfg, state):
    name = "model.layers.0.self_attn.k_proj.weight"   # HF [out, in] = [2 * 10, 60]
    state[name] = np.zeros((30, 60), np.float32)
    with pytest.raises(ValueError) as err:
        _load(cfg, state)
    msg = str(err.value)
    assert name in msg and "(30, 60)" in msg and "(60, 20)" in msg, msg


def test_every_problem_is_reported_at_once(cfg, state):
    del state["model.norm.weight"]
    state["model.extra.weight"] = np.zeros(3, np.float32)
    state["lm_head.weight"] = np.zeros((80, 61), np.float32)
    with pytest.raises(ValueError) as err:
        _load(cfg, state)
    msg = str(err.value)
    assert "model.norm.weight" in msg and "model.extra.weight" in msg and "lm_head.weight" in msg


def test_rope_buffers_are_ignored(cfg, state):
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(5, np.float32)
    _load(cfg, state)


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["GPT2LMHeadModel"], vocab_size=80, hidden_size=60, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=6)))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_hf_dir(str(tmp_path), jnp.float32)
    for arch in supported_architectures():
        assert arch in str(err.value)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM"} <= set(supported_architectures())


def test_nonexistent_directory_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_hf_dir(missing, jnp.float32)


def _write_sharded(hf_model, state, model_dir):
    """Two shards, an index, and config.json, as `save_pretrained` lays them out."""
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: state[n] for n in part}, os.path.join(model_dir, file))
    index = {"metadata": {"total_size": sum(a.nbytes for a in state.values())},
             "weight_map": {n: f for f, part in shards.items() for n in part}}
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_model.config.to_dict(), f)


def test_sharded_directory_round_trip(hf_model, state, tmp_path):
    _write_sharded(hf_model, state, str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    model, cfg, gen = load_hf_dir(str(tmp_path), jnp.float32)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.head_dim == 10
    assert gen == {"temperature": 0.6}
    err = np.abs(prefill_logits(model, cfg, TOKENS) - hf_logits(hf_model, TOKENS)).max()
    assert err <= 1e-4


def test_index_naming_absent_shard_is_an_error(hf_model, state, tmp_path):
    _write_sharded(hf_model, state, str(tmp_path))
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_hf_dir(str(tmp_path), jnp.float32)


def test_bf16_safetensors(hf_model, state, tmp_path):
    bf16 = {n: a.astype(ml_dtypes.bfloat16) for n, a in state.items()}
    _write_sharded(hf_model, bf16, str(tmp_path))

    model16, _, _ = load_hf_dir(str(tmp_path), jnp.bfloat16)
    kernel = model16.model.layers[0].self_attn.q_proj.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kernel).T,
                                  bf16["model.layers.0.self_attn.q_proj.weight"])

    # Upcast on load: exactly HF with its weights rounded to bf16.
    model32, cfg, _ = load_hf_dir(str(tmp_path), jnp.float32)
    rounded = tiny_hf_model("LlamaConfig", "LlamaForCausalLM", seed=0,
                            **{k: getattr(hf_model.config, k) for k in (
                                "vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "max_position_embeddings")})
    rounded.load_state_dict({n: torch.from_numpy(a.astype(np.float32)) for n, a in bf16.items()})
    err = np.abs(prefill_logits(model32, cfg, TOKENS) - hf_logits(rounded, TOKENS)).max()
    assert err <= 1e-4
