"""Random PEFT LoRA adapters for the tiny test models (tests only).

Owns writing an adapter directory exactly as PEFT saves one (adapter_config.json +
adapter_model.safetensors): with peft itself (`init_lora_weights=False`, so B != 0 and the
adapter changes the outputs) where the HF references are needed (the PeftModel for generate,
the merged model for logits), or with numpy alone where only the engine reads it.
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import numpy as np

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(hf_model, out_dir: str, seed: int, r: int = 8, lora_alpha: int = 16,
                       target_modules=ALL_TARGETS, use_rslora: bool = False, scale=0.3):
    """Save a random adapter of `hf_model` (left unchanged) into out_dir; -> the PeftModel.
    `scale` shrinks PEFT's random init, so the adapted model stays a sensible network."""
    import peft
    import torch

    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                             init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0)
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # transformers' deprecations, as peft calls it
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(hf_model), config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.mul_(scale)
        model.save_pretrained(out_dir)
    return model


def merged(peft_model):
    """The base model with the adapter merged into its weights (a copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return copy.deepcopy(peft_model).merge_and_unload().eval()


def write_random_adapter(path, config: dict, seed: int, r: int = 4) -> str:
    """A PEFT-format adapter of q_proj and down_proj on every layer of a Llama of `config`
    (tiny_model.TINY_CONFIG's keys), B != 0, written with numpy (no peft, no HF model)."""
    c = config
    rng = np.random.default_rng(seed)
    dims = {"self_attn.q_proj": (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
            "mlp.down_proj": (c["intermediate_size"], c["hidden_size"])}
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for module, (k, n) in dims.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.3, (r, k)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.3, (n, r)).astype(np.float32)
    from jaxllm.models.safetensors_io import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                   "target_modules": ["q_proj", "down_proj"]}, f)
    return str(path)
