"""OPT (and, through gpt2.py, GPT-2): learned positions, LayerNorm with bias, a plain MLP.

Owns: the decoder of the learned-position families, pre-norm or post-norm
(`do_layer_norm_before`; OPT-350m is post-norm and has no final LayerNorm), with OPT's
narrower word embeddings (`word_embed_proj_dim`: project_in after the lookup, project_out
before the tied LM head), and OPT's checkpoint names mapped onto the Llama-style parameter
paths that models/sharding.py and models/tp_layout.py already lay out for tensor parallelism.
The forward contract, hooks and attention are LlamaForCausalLM's (models/llama.py); never
rope, never a gated MLP.

Letters: T tokens, D hidden size, E word embedding size (D unless word_embed_proj_dim),
S rows whose logits are computed.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.base import AttentionMetadata, KVCache
from jaxllm.models.config import ModelConfig
from jaxllm.models.hooks import NO_HOOKS, StepHooks
from jaxllm.models.layers import (Attention, DenseMLP, LearnedPositionEmbedding, _linear,
                                  make_norm)
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.parallel import ParallelOps


class OPTDecoderLayer(nnx.Module):
    """input_layernorm is HF OPT's self_attn_layer_norm, post_attention_layernorm its (per
    layer) final_layer_norm: before their block when pre-norm, after the residual add when
    post-norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, layer=layer_idx)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, dtype=dtype)
        self.mlp = DenseMLP(cfg, dtype=dtype, rngs=rngs)
        self.pre_norm = cfg.do_layer_norm_before

    def __call__(self, x_TD, kv, md, ops, hooks: StepHooks = NO_HOOKS, i: int = 0):
        pre = self.pre_norm
        x_TD = hooks.at("resid_pre", i, x_TD)
        h_TD, kv = self.self_attn(self.input_layernorm(x_TD) if pre else x_TD, kv, md, ops,
                                  hooks, i)
        x_TD = x_TD + hooks.at("attn_out", i, h_TD)
        if not pre:
            x_TD = self.input_layernorm(x_TD)
        h_TD = self.mlp(self.post_attention_layernorm(x_TD) if pre else x_TD, ops)
        x_TD = x_TD + hooks.at("mlp_out", i, h_TD)
        if not pre:
            x_TD = self.post_attention_layernorm(x_TD)
        return hooks.at("resid_post", i, x_TD), kv


class OPTModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        D, E = cfg.hidden_size, cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = nnx.Embed(cfg.num_embeddings, E, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs)
        self.embed_positions = LearnedPositionEmbedding(
            cfg.max_position_embeddings, D, cfg.learned_position_offset, dtype=dtype)
        self.project_in = _linear(E, D, False, dtype, rngs) if E != D else None
        self.project_out = _linear(D, E, False, dtype, rngs) if E != D else None
        self.layers = nnx.List([OPTDecoderLayer(cfg, i, dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = make_norm(cfg, D, dtype=dtype) if cfg.final_norm else None

    def __call__(self, md: AttentionMetadata, kv_caches: KVCache, ops: ParallelOps,
                 hooks: StepHooks = NO_HOOKS):
        x_TE = ops.embed(self.embed_tokens.embedding[...], md.input_ids,
                         features=self.embed_tokens.features)
        x_TD = x_TE if self.project_in is None else ops.linear(self.project_in, x_TE)
        x_TD = x_TD + self.embed_positions(md.positions).astype(x_TD.dtype)
        new_caches = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x_TD, kv = layer(x_TD, kv, md, ops, hooks, i)
            new_caches.append(kv)
        if self.norm is not None:
            x_TD = self.norm(x_TD)
        return hooks.at("final_norm", None, x_TD), new_caches


class OPTForCausalLM(LlamaForCausalLM):
    """Llama's head, weight processing and max-model-len seam over the OPT decoder; the
    hidden states it returns are [T, D], project_out runs on the S rows whose logits are
    computed."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.model = OPTModel(cfg, dtype=dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Linear(
            cfg.word_embed_proj_dim or cfg.hidden_size, cfg.num_embeddings, use_bias=False,
            dtype=dtype, param_dtype=dtype, rngs=rngs)

    def compute_logits(self, hidden_SD, ops: ParallelOps):
        out = self.model.project_out
        return super().compute_logits(
            hidden_SD if out is None else ops.linear(out, hidden_SD), ops)

    @classmethod
    def adapt_checkpoint(cls, cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]]
                         ) -> Iterator[tuple[str, np.ndarray]]:
        """OPT's names -> ours (metaseq-era checkpoints lack the `model.` prefix)."""
        for name, tensor in tensors:
            yield _rename(_OPT_NAMES, name), tensor


# (pattern, replacement) applied in order; the first that matches renames.
_OPT_NAMES = [
    (r"^(model\.)?decoder\.final_layer_norm\.", "model.norm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.self_attn\.out_proj\.",
     r"model.layers.\2.self_attn.o_proj."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.self_attn_layer_norm\.",
     r"model.layers.\2.input_layernorm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.final_layer_norm\.",
     r"model.layers.\2.post_attention_layernorm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.(fc[12])\.", r"model.layers.\2.mlp.\3."),
    (r"^(model\.)?decoder\.", "model."),
]


def _rename(rules, name: str) -> str:
    for pattern, replacement in rules:
        new, n = re.subn(pattern, replacement, name)
        if n:
            return new
    return name
