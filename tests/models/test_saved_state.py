"""Saved states (models/saved_state.py, LLM.save_sharded_state): a save and a restore give the
engine's parameters bit for bit and its greedy tokens, edits included; a state is served only
with the key it was saved with (dtype, linear method; the TP size in
tests/parallel/test_saved_state_tp.py); a half-written, damaged or misfitting state is never
used, and the error names it."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine_e2e.tiny_model import SMALL, build_tiny_llama_dir, greedy, token_ids
from jaxllm import LLM
from jaxllm.models.resolve import resolve_model
from jaxllm.models.saved_state import StateKey, is_saved_state, read_key

PROMPTS = [{"prompt_token_ids": [100 + i for i in range(n)]} for n in (5, 23)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def original(tiny_dir):
    return LLM(tiny_dir, **SMALL)


def model_params(state_or_model) -> dict[str, np.ndarray]:
    state = (state_or_model if isinstance(state_or_model, nnx.State)
             else nnx.state(state_or_model))
    return {".".join(map(str, path)): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(state)}


def params(llm) -> dict[str, np.ndarray]:
    return model_params(llm.llm_engine.runner.state)


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name].dtype, got[name].shape) == (want[name].dtype, want[name].shape), name
        assert got[name].tobytes() == want[name].tobytes(), name


def test_round_trip_gives_the_same_parameters_and_tokens(original, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = "saved"  # relative, as in the README
    original.save_sharded_state(saved)
    assert resolve_model(saved).kind == "saved_state"
    # The tokenizer's files are whatever transformers' save_pretrained writes.
    assert {"config.json", "generation_config.json", "jaxllm_state.json", "state",
            "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(saved))
    method = original.llm_engine.runner.linear_method
    assert read_key(saved) == StateKey("float32", 1, method.name,
                                       method.weight_format(jnp.float32))
    restored = LLM(saved, **SMALL)
    assert restored.llm_engine.runner.linear_method is method
    assert_bitwise_equal(params(restored), params(original))
    assert (token_ids(restored.generate(PROMPTS, greedy(12), use_tqdm=False))
            == token_ids(original.generate(PROMPTS, greedy(12), use_tqdm=False)))
    with pytest.raises(FileExistsError, match="already exists"):
        original.save_sharded_state(saved)


def test_edited_parameters_are_what_is_saved(tiny_dir, tmp_path):
    llm = LLM(tiny_dir, **SMALL)
    norm = llm.llm_engine.runner.state["model"]["norm"]["weight"]
    norm.set_value(norm.get_value() * 3.0)  # a researcher's edit, in place
    edited = params(llm)
    saved = str(tmp_path / "edited")
    llm.save_sharded_state(saved)
    restored = LLM(saved, **SMALL)
    assert_bitwise_equal(params(restored), edited)
    assert (token_ids(restored.generate(PROMPTS, greedy(8), use_tqdm=False))
            == token_ids(llm.generate(PROMPTS, greedy(8), use_tqdm=False)))


def test_a_state_is_served_only_with_its_own_key(original, tmp_path):
    saved = str(tmp_path / "saved")
    original.save_sharded_state(saved)
    with pytest.raises(ValueError, match=r"saved with dtype 'float32' \(asked for 'bfloat16'\)"):
        LLM(saved, **{**SMALL, "dtype": "bfloat16"})
    if original.llm_engine.runner.linear_method.name == "cpu":
        with pytest.raises(ValueError, match=r"linear_method 'cpu' \(asked for 'xla'\)"):
            LLM(saved, **SMALL, linear_backend="xla")


def test_a_damaged_state_is_refused_naming_it(original, tmp_path):
    saved = str(tmp_path / "saved")
    original.save_sharded_state(saved)
    for root, _, files in os.walk(os.path.join(saved, "state")):
        for name in files:
            if os.path.getsize(os.path.join(root, name)) > 4096:  # the parameters' data
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(100)
    with pytest.raises(ValueError, match=f"the state saved in {saved} cannot be restored"):
        LLM(saved, **SMALL)


def test_a_half_written_state_is_not_a_state(original, tmp_path):
    saved = str(tmp_path / "saved")
    original.save_sharded_state(saved)
    os.remove(os.path.join(saved, "jaxllm_state.json"))  # written last: the save stopped before
    assert not is_saved_state(saved)
    assert resolve_model(saved).kind == "hf_dir"
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        LLM(saved, **SMALL)
    # Nothing half-written is left beside a finished save either.
    assert [n for n in os.listdir(tmp_path) if n.startswith(".partial-")] == []


def test_a_state_that_does_not_fit_its_config_is_refused(original, tmp_path):
    saved = str(tmp_path / "saved")
    original.save_sharded_state(saved)
    with open(os.path.join(saved, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(saved, "config.json"), "w") as f:
        json.dump({**config, "intermediate_size": config["intermediate_size"] // 2}, f)
    with pytest.raises(ValueError, match=f"the state saved in {saved} does not fit its "
                                         r"config.json: .*\['mlp'\]\['down_proj'\]\['kernel'\]: "
                                         r"saved float32\[[0-9, ]+\], model float32\["):
        LLM(saved, **SMALL)
