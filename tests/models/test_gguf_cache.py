"""The converted-GGUF cache: the second load of the embedded SmolLM2 reads the converted copy
and gives exactly the first load's parameters and tokenizer; a partial copy is never used;
the config read before loading is the loaded one, from the GGUF's parse (reused) or the
converted copy."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import gguf_cache
from jaxllm.models.checkpoint import load_checkpoint, read_checkpoint_config
from jaxllm.models.resolve import resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_second_load_reads_the_converted_copy_and_changes_nothing(cache, dtype):
    resolved = resolve_model(None)
    assert resolved.kind == "gguf"
    # The config first (dtype="auto" is timed at its shapes): the GGUF's parse, reused.
    early_cfg, reader = read_checkpoint_config(resolved)
    assert reader is not None
    first_model, first_cfg, first_gen, first_tok = load_checkpoint(resolved, dtype,
                                                                   reader=reader)
    assert early_cfg == first_cfg
    converted = gguf_cache.find_converted(resolved.path, dtype)
    assert converted is not None and converted.startswith(str(cache))
    assert read_checkpoint_config(resolved) == (first_cfg, None)  # from the converted copy
    second_model, second_cfg, second_gen, second_tok = load_checkpoint(resolved, dtype)
    assert (second_cfg, second_gen) == (first_cfg, first_gen)
    a, b = jax.tree.leaves(first_model), jax.tree.leaves(second_model)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    text = "Hello, world! <|im_start|>user\nÜber 🎉"
    assert second_tok(text)["input_ids"] == first_tok(text)["input_ids"]
    assert second_tok.eos_token_id == first_tok.eos_token_id
    assert second_tok.chat_template == first_tok.chat_template


def test_a_partial_copy_is_not_used(cache):
    resolved = resolve_model(None)
    path = gguf_cache.converted_dir(resolved.path, jnp.bfloat16)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:  # no weights, no tokenizer
        f.write("{}")
    assert gguf_cache.find_converted(resolved.path, jnp.bfloat16) is None


def test_no_cache_writes_nothing(cache):
    load_checkpoint(resolve_model(None), jnp.bfloat16, use_cache=False)
    assert not os.path.exists(cache / "models")


def test_loading_never_imports_torch(tmp_path):
    """Cold (GGUF parsed and converted) and warm (the converted copy) loads in a fresh
    interpreter, with torch installed: neither imports it (transformers' AutoTokenizer
    would, ~300 MiB of memory jaxllm never uses)."""
    import subprocess
    import sys

    code = ("import sys, jax.numpy as jnp\n"
            "from jaxllm.models.resolve import resolve_model\n"
            "from jaxllm.models.checkpoint import load_checkpoint\n"
            "load_checkpoint(resolve_model(None), jnp.bfloat16)\n"
            "print('torch' in sys.modules)\n")
    env = {**os.environ, "JAXLLM_CACHE_DIR": str(tmp_path)}
    for _ in ("cold", "warm"):
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip().splitlines()[-1] == "False"
    assert os.listdir(tmp_path)  # the first load wrote the converted copy
