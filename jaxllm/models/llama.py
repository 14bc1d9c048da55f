"""The Llama-family decoder: Llama 2/3/3.x, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (qk norm).

Owns: the network, as a Flax NNX module that the step splits once into (graphdef, state).
The forward is functional at the step boundary: (tokens, kv_caches, metadata) in,
(hidden, kv_caches) out; the caller donates kv_caches. What runs per shard under tensor
parallelism (attention, the embedding lookup, the LM head) goes through the `ParallelOps`
the caller passes (models/parallel.py). The residual stream passes the step's features at
its named sites (`hooks.at`, models/hooks.py; the identity without features).
Never reads global state.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels.linear_methods import LinearMethod
from jaxllm.models.base import AttentionMetadata, KVCache
from jaxllm.models.config import ModelConfig
from jaxllm.models.hooks import NO_HOOKS, StepHooks
from jaxllm.models.layers import MLP, Attention, RMSNorm
from jaxllm.models.parallel import ParallelOps


def dense_mlp(cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
    """Layer `layer`'s feed-forward block: Llama's gated MLP on every layer. A family with
    other blocks (models/moe.py) passes its own `mlp_for_layer` of this signature."""
    return MLP(cfg, dtype=dtype, rngs=rngs)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, layer: int = 0,
                 mlp_for_layer=dense_mlp):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = mlp_for_layer(cfg, layer, dtype=dtype, rngs=rngs)

    def __call__(self, x_TD, kv, md, ops, hooks: StepHooks = NO_HOOKS, i: int = 0):
        x_TD = hooks.at("resid_pre", i, x_TD)
        h_TD, kv = self.self_attn(self.input_layernorm(x_TD), kv, md, ops, hooks, i)
        x_TD = x_TD + hooks.at("attn_out", i, h_TD)
        x_TD = x_TD + hooks.at("mlp_out", i, self.mlp(self.post_attention_layernorm(x_TD), ops))
        return hooks.at("resid_post", i, x_TD), kv


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, mlp_for_layer=dense_mlp):
        self.embed_tokens = nnx.Embed(cfg.num_embeddings, cfg.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs, layer=i,
                                             mlp_for_layer=mlp_for_layer)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, md: AttentionMetadata, kv_caches: KVCache, ops: ParallelOps,
                 hooks: StepHooks = NO_HOOKS):
        x_TD = ops.embed(self.embed_tokens.embedding[...], md.input_ids,
                         features=self.embed_tokens.features)
        new_caches = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x_TD, kv = layer(x_TD, kv, md, ops, hooks, i)
            new_caches.append(kv)
        return hooks.at("final_norm", None, self.norm(x_TD)), new_caches


class LlamaForCausalLM(nnx.Module):
    """Also serves Mistral, Qwen2 and Qwen3: their differences live in ModelConfig flags.
    A subclass changes the feed-forward blocks by its `mlp_for_layer` (models/moe.py)."""

    mlp_for_layer = staticmethod(dense_mlp)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.model = LlamaModel(cfg, dtype=dtype, rngs=rngs, mlp_for_layer=self.mlp_for_layer)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Linear(
            cfg.hidden_size, cfg.num_embeddings, use_bias=False, dtype=dtype,
            param_dtype=dtype, rngs=rngs)

    def __call__(self, md: AttentionMetadata, kv_caches: KVCache, ops: ParallelOps,
                 hooks: StepHooks = NO_HOOKS):
        """-> (hidden [T, D], kv_caches)."""
        return self.model(md, kv_caches, ops, hooks)

    def process_weights_after_loading(self, method: LinearMethod) -> None:
        """Store every dense weight in the form `method` multiplies (vLLM's name), once, after
        loading; the step must then run with `ops.linear_method` = `method`. A tied embedding
        is both the lookup table and the LM head: it is stored once, as the method's LM head,
        and the lookup reads it there."""
        for _, module in nnx.iter_modules(self):
            if isinstance(module, nnx.Linear):
                module.kernel = nnx.Param(method.process_weights_after_loading(module.kernel[...]))
        if self.lm_head is None:
            embed = self.model.embed_tokens
            embed.embedding = nnx.Param(method.process_embedding(embed.embedding[...]))

    def compute_logits(self, hidden_SD, ops: ParallelOps):
        """[S, D] -> [S, V] float32 logits (matmul in the parameter dtype, f32 accumulate)."""
        V = self.config.vocab_size
        if self.lm_head is None:
            return ops.logits(hidden_SD, self.model.embed_tokens.embedding[...],
                              spec="sd,vd->sv", vocab_size=V)
        return ops.logits(hidden_SD, self.lm_head.kernel[...], spec="sd,dv->sv",
                          vocab_size=V)


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's K (or V) cache: [num_blocks, block_size, K, H]."""
    return (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)


def init_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype,
                   sharding=None) -> KVCache:
    shape = kv_cache_shape(cfg, num_blocks, block_size)
    zeros = lambda: jnp.zeros(shape, dtype, device=sharding)  # noqa: E731
    return [(zeros(), zeros()) for _ in range(cfg.num_hidden_layers)]


__all__ = ["LlamaForCausalLM", "init_kv_caches", "kv_cache_shape"]
