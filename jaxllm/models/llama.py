"""The Llama-family decoder: Llama 2/3/3.x, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (qk norm).

Owns: the network, as a Flax NNX module that the step splits once into (graphdef, state).
The forward is functional at the step boundary: (tokens, kv_caches, metadata) in,
(hidden, kv_caches) out; the caller donates kv_caches. Never reads global state.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels import get_attention_fn
from jaxllm.models.base import AttentionMetadata, KVCache
from jaxllm.models.config import ModelConfig
from jaxllm.models.layers import MLP, Attention, RMSNorm


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x_TD, kv, md, attn_fn):
        h_TD, kv = self.self_attn(self.input_layernorm(x_TD), kv, md, attn_fn)
        x_TD = x_TD + h_TD
        x_TD = x_TD + self.mlp(self.post_attention_layernorm(x_TD))
        return x_TD, kv


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, md: AttentionMetadata, kv_caches: KVCache, attn_fn):
        x_TD = self.embed_tokens(md.input_ids)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x_TD, kv = layer(x_TD, kv, md, attn_fn)
            new_caches.append(kv)
        return self.norm(x_TD), new_caches


class LlamaForCausalLM(nnx.Module):
    """Also serves Mistral, Qwen2 and Qwen3: their differences live in ModelConfig flags."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.model = LlamaModel(cfg, dtype=dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Linear(
            cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
            rngs=rngs)

    def __call__(self, md: AttentionMetadata, kv_caches: KVCache,
                 attention_backend: str = "xla"):
        """-> (hidden [T, D], kv_caches). The backend name is static (a Python string)."""
        return self.model(md, kv_caches, get_attention_fn(attention_backend))

    def compute_logits(self, hidden_SD):
        """[S, D] -> [S, V] float32 logits (matmul in the parameter dtype, f32 accumulate)."""
        if self.lm_head is None:
            w_VD = self.model.embed_tokens.embedding[...]
            return jnp.einsum("sd,vd->sv", hidden_SD, w_VD, preferred_element_type=jnp.float32)
        w_DV = self.lm_head.kernel[...]
        return jnp.einsum("sd,dv->sv", hidden_SD, w_DV, preferred_element_type=jnp.float32)


def init_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype,
                   sharding=None) -> KVCache:
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype, device=sharding)  # noqa: E731
    return [(zeros(), zeros()) for _ in range(cfg.num_hidden_layers)]


__all__ = ["LlamaForCausalLM", "init_kv_caches"]
