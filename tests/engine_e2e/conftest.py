"""Fixtures for the engine's end-to-end tests: one tiny random Llama, the real SmolLM2, HF.

Engines are expensive here (each compiles its own buckets), so the shared ones are
session-scoped and small: max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
compiled lazily (enforce_eager=True) unless warm-up is what a test is about. Tests that need
another configuration build their own with `make_tiny_llm(**overrides)`.

Counters in `get_metrics()` are engine-lifetime, so tests on a shared engine compare
differences, never absolute values.
"""

from __future__ import annotations


import pytest

from jaxllm import LLM

from tiny_model import SMALL, build_tiny_llama_dir, smollm2_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> str:
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_llama")), tokenizer)


@pytest.fixture(scope="session")
def make_tiny_llm(tiny_model_dir):
    """LLM(tiny model, SMALL config updated with the overrides)."""
    def make(**overrides) -> LLM:
        return LLM(tiny_model_dir, **{**SMALL, **overrides})

    return make


@pytest.fixture(scope="session")
def tiny_llm(make_tiny_llm) -> LLM:
    """The shared tiny engine (roomy KV cache, budget 64)."""
    return make_tiny_llm()


@pytest.fixture(scope="session")
def real_llm() -> LLM:
    """The real default model (SmolLM2-135M-Instruct from the embedded GGUF)."""
    return LLM(**SMALL)
