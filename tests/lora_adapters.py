"""Random PEFT LoRA adapters for the tiny test models (peft + torch, tests only).

Owns writing an adapter directory exactly as PEFT saves one (adapter_config.json +
adapter_model.safetensors) with `init_lora_weights=False`, so B != 0 and the adapter changes
the outputs, and the HF references: the PeftModel (generate) and the merged model (logits).
"""

from __future__ import annotations

import copy
import warnings

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
