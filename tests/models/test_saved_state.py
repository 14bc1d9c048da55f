"""Saved states (models/saved_state.py, LLM.save_sharded_state): a save and a restore give the
engine's parameters bit for bit and its greedy tokens, edits included; a state is served only
with the key it was saved with; a half-written or damaged state is never used, and the user
is told; cache entries (models/state_cache.py) miss when any part of the key differs."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine_e2e.tiny_model import SMALL, build_tiny_llama_dir, greedy, token_ids
from jaxllm import LLM
from jaxllm.kernels.linear_methods import get_linear_method
from jaxllm.models.resolve import ResolvedModel, resolve_model
from jaxllm.models.saved_state import StateKey, is_saved_state, read_key, save_state
from jaxllm.models.state_cache import find_cached_state, state_cache_dir

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


def test_round_trip_gives_the_same_parameters_and_tokens(original, tmp_path):
    saved = str(tmp_path / "saved")
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


# ---- the cache's entries for a GGUF -------------------------------------------------------

@pytest.fixture()
def fake_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")  # only its identity is read here
    return ResolvedModel("gguf", str(path), "model")


def test_cache_entries_miss_when_the_key_differs(original, fake_gguf):
    engine = original.llm_engine
    method = engine.runner.linear_method
    other_method = get_linear_method("xla" if method.name == "cpu" else "cpu")
    key = StateKey.of(jnp.float32, 1, method)
    assert find_cached_state(fake_gguf, key) is None
    save_state(state_cache_dir(fake_gguf, key), engine.runner.state, key, {}, {},
               engine.tokenizer, exist_ok=True)
    assert find_cached_state(fake_gguf, key) == state_cache_dir(fake_gguf, key)
    # Saving again (another process got there first) leaves the entry as it was.
    save_state(state_cache_dir(fake_gguf, key), engine.runner.state, key, {}, {},
               engine.tokenizer, exist_ok=True)
    others = [StateKey.of(jnp.bfloat16, 1, method), StateKey.of(jnp.float32, 1, other_method),
              StateKey.of(jnp.float32, 2, method),
              dataclasses.replace(key, weight_format=key.weight_format + ", v2"),
              dataclasses.replace(key, format_version=0)]
    for other in others:
        assert find_cached_state(fake_gguf, other) is None, other
    os.utime(fake_gguf.path, ns=(0, 0))  # the file changed
    assert find_cached_state(fake_gguf, key) is None


@pytest.mark.slow
def test_a_damaged_cache_entry_is_reported_and_bypassed(caplog, tmp_path, monkeypatch):
    """The real GGUF: the first load saves the state, a damaged one is warned about and the
    converted copy loaded instead, to the same bits."""
    from jaxllm.models.checkpoint import load_for_engine
    from jaxllm.models.sharding import Placement, make_mesh

    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path))
    resolved, placement = resolve_model(None), Placement(make_mesh(1))
    method = get_linear_method("xla")
    first = load_for_engine(resolved, jnp.bfloat16, method, placement=placement)
    assert first.source == "checkpoint"
    entry = find_cached_state(resolved, StateKey.of(jnp.bfloat16, 1, method))
    assert entry is not None
    second = load_for_engine(resolved, jnp.bfloat16, method, placement=placement)
    assert second.source == "cached state"
    assert_bitwise_equal(model_params(second.model), model_params(first.model))
    with open(os.path.join(entry, "jaxllm_state.json")) as f:
        key = json.load(f)
    with open(os.path.join(entry, "jaxllm_state.json"), "w") as f:
        json.dump({**key, "surprise": 1}, f)
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        third = load_for_engine(resolved, jnp.bfloat16, method, placement=placement)
    assert third.source == "checkpoint"
    assert [r.getMessage() for r in caplog.records] == [
        f"{os.path.join(entry, 'jaxllm_state.json')} is not a jaxllm saved-state key: "
        f"StateKey.__init__() got an unexpected keyword argument 'surprise'; loading "
        f"{resolved.name} from its checkpoint instead (delete {entry} to have it saved again)"]
