"""Tiny random Hugging Face models, the one way every test builds them.

Owns the randomization: every parameter drawn (HF zero-inits biases and sets norms to one,
which would hide a missing bias or norm), norms near one, everything else N(0, 0.15). The
spread is larger than HF's init (0.02) so logits are peaked and greedy argmaxes sit far from
ties: a batch-vs-alone comparison then tests the engine, not the last bit of float32
summation order. torch is imported lazily (jaxllm itself never needs it).
"""

from __future__ import annotations

import re

_GPT2_NORM = re.compile(r"\.ln_(\d+|f)\.weight$")
STD = 0.15
NORM_STD = 0.1


def tiny_hf_model(config_cls_name: str, arch: str, seed: int, **config_kwargs):
    """A `transformers` model of class `arch`, every parameter random (seeded)."""
    import torch
    import transformers

    hf_cfg = getattr(transformers, config_cls_name)(attn_implementation="eager", **config_kwargs)
    hf_cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # GPT-2 names its LayerNorms ln_1, ln_2, ln_f.
            if name.endswith("norm.weight") or _GPT2_NORM.search(name):
                p.data.normal_(1.0, NORM_STD)
            else:
                p.data.normal_(0.0, STD)
    return model
