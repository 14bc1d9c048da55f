"""The real SmolLM2 in bfloat16 (what dtype="auto" runs on a CPU where bf16 measures faster)
against HF transformers in bfloat16 and float32, on one 84-token prompt, every position.

Tolerances, from what bf16 itself costs: HF's own bf16 model differs from HF f32 by a mean
|logit error| of 0.14 (max 1.05, top-1 agreement 0.988, logit std 8.9), measured on this
prompt. Two independent bf16 computations can be up to twice as far apart: ours vs HF bf16
must stay within mean 0.3 and max 2.5 with top-1 agreement >= 0.95 (measured: 0.135, 1.34,
0.976). And ours must be no less accurate than HF's bf16 against the f32 reference (measured
mean 0.115 vs 0.142): at most 1.25x HF's error, and pick HF f32's top-1 token at >= 0.97 of
the positions (issue 16's bar for letting dtype="auto" choose bf16).
"""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.gguf import load_gguf
from jaxllm.models.resolve import embedded_default_gguf
from jaxllm.tokenizer import get_tokenizer
from helpers import prefill_logits

pytestmark = pytest.mark.slow

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press. "
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
        "fibonacci(n - 2)\nOnce upon a time, in a small village by the sea, there lived an old "
        "fisherman who")


@pytest.fixture(scope="module")
def logits(hf_smollm2):
    import torch

    path = embedded_default_gguf()
    ids = get_tokenizer(path)(TEXT)["input_ids"]
    hf_bf16 = copy.deepcopy(hf_smollm2).to(torch.bfloat16)
    with torch.no_grad():
        ref_bf16 = hf_bf16(torch.tensor([ids])).logits[0].float().numpy()
        ref_f32 = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    model, cfg, _ = load_gguf(path, jnp.bfloat16)
    ours = prefill_logits(model, cfg, ids, block_size=16, dtype=jnp.bfloat16)
    return ours, ref_bf16, ref_f32


def test_bf16_matches_hf_bf16(logits):
    ours, ref_bf16, _ = logits
    err = np.abs(ours - ref_bf16)
    agree = float(np.mean(ours.argmax(-1) == ref_bf16.argmax(-1)))
    print(f"\n[bf16] ours vs HF bf16 over {len(ours)} positions: top-1 {agree:.3f}, "
          f"mean |err| {err.mean():.3f}, max {err.max():.2f}")
    assert agree >= 0.95
    assert err.mean() <= 0.3 and err.max() <= 2.5


def test_bf16_is_as_accurate_as_hf_bf16(logits):
    ours, ref_bf16, ref_f32 = logits
    ours_err = float(np.abs(ours - ref_f32).mean())
    hf_err = float(np.abs(ref_bf16 - ref_f32).mean())
    print(f"\n[bf16] mean |err| vs HF f32: ours {ours_err:.3f}, HF bf16 {hf_err:.3f}")
    assert ours_err <= 1.25 * hf_err


def test_bf16_top1_agrees_with_hf_f32(logits):
    ours, _, ref_f32 = logits
    agree = float(np.mean(ours.argmax(-1) == ref_f32.argmax(-1)))
    print(f"\n[bf16] ours vs HF f32 over {len(ours)} positions: top-1 {agree:.3f}")
    assert agree >= 0.97
