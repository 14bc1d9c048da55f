"""The Gemma family: Gemma, Gemma 2 and Gemma 3 (text), as Llama with a handful of flags.

Owns what no flag of the Llama decoder covers: the residual layout of Gemma 2/3 ("sandwich"
norms: the attention output is normalized before it joins the residual, and the MLP sits
between a pre- and a post-feedforward norm), embeddings scaled by sqrt(hidden_size), and the
final logit soft-cap. Everything else is ModelConfig (models/config.py) read by the shared
layers (models/layers.py): the (1 + w) RMSNorm, GeGLU, query_pre_attn_scalar, Gemma 3's
QK-norm, the attention soft-cap and the per-layer sliding window with Gemma 3's local RoPE
base. Letters as in layers.py. Never reads global state.

    Gemma:     x += attn(norm_in(x));                  x += mlp(norm_post_attn(x))
    Gemma 2/3: x += norm_post_attn(attn(norm_in(x)));  x += norm_post_ff(mlp(norm_pre_ff(x)))
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from jaxllm.models.config import ModelConfig
from jaxllm.models.hooks import NO_HOOKS, StepHooks
from jaxllm.models.layers import Attention, rms_norm
from jaxllm.models.llama import LlamaForCausalLM, LlamaModel, dense_mlp
from jaxllm.models.parallel import ParallelOps


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, layer: int = 0,
                 mlp_for_layer=dense_mlp):
        D = cfg.hidden_size
        self.input_layernorm = rms_norm(cfg, D, dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, layer=layer)
        self.post_attention_layernorm = rms_norm(cfg, D, dtype)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = rms_norm(cfg, D, dtype)
            self.post_feedforward_layernorm = rms_norm(cfg, D, dtype)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        self.mlp = mlp_for_layer(cfg, layer, dtype=dtype, rngs=rngs)

    def __call__(self, x_TD, kv, md, ops, hooks: StepHooks = NO_HOOKS, i: int = 0):
        x_TD = hooks.at("resid_pre", i, x_TD)
        h_TD, kv = self.self_attn(self.input_layernorm(x_TD), kv, md, ops, hooks, i)
        if self.pre_feedforward_layernorm is None:  # Gemma: Llama's layout
            x_TD = x_TD + hooks.at("attn_out", i, h_TD)
            h_TD = self.mlp(self.post_attention_layernorm(x_TD), ops)
        else:
            x_TD = x_TD + hooks.at("attn_out", i, self.post_attention_layernorm(h_TD))
            h_TD = self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(x_TD), ops))
        x_TD = x_TD + hooks.at("mlp_out", i, h_TD)
        return hooks.at("resid_post", i, x_TD), kv


class GemmaModel(LlamaModel):
    decoder_layer = GemmaDecoderLayer

    def embed(self, md, ops: ParallelOps):
        x_TD = super().embed(md, ops)
        # HF multiplies by sqrt(hidden_size) rounded to the embedding's dtype (25.25 in bf16
        # for 640, not 25.30): the same here.
        return x_TD * jnp.asarray(math.sqrt(self.embed_tokens.features), x_TD.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """Serves Gemma, Gemma 2 and Gemma 3 (text): their differences are ModelConfig flags."""

    model_class = GemmaModel

    def compute_logits(self, hidden_SD, ops: ParallelOps):
        """[S, D] -> [S, V] float32 logits, soft-capped (Gemma 2/3: c * tanh(logits / c))."""
        logits_SV = super().compute_logits(hidden_SD, ops)
        cap = self.config.final_logit_softcapping
        return logits_SV if cap is None else cap * jnp.tanh(logits_SV / cap)


__all__ = ["GemmaForCausalLM"]
