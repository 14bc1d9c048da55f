"""Llama-family decoders as pooling models: `*Model` (embeddings, e.g. Qwen3-Embedding, or a
causal LM turned into one by `convert="embed"`) and `*ForSequenceClassification` (a linear
`score` head on the pooled row, e.g. Qwen3 rerankers).

Owns the two thin wrappers over LlamaModel and their checkpoint names: a causal LM's
`lm_head` is dropped; a bare `Qwen3Model` checkpoint (no `model.` prefix) is read under
`model.`. Never holds a KV cache: which tokens attention sees is the pooling step's
`ops.attention` (causal, jaxllm/pooling/attention.py); the layers are LlamaModel's, unchanged.

Letters: T tokens, D model dim, S sequences, C classes.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxllm.models.config import ModelConfig
from jaxllm.models.layers import _linear
from jaxllm.models.llama import LlamaModel, dense_mlp


def _under_model(tensors, keep_head: str | None):
    for name, tensor in tensors:
        if name.startswith("lm_head."):
            continue
        if keep_head is not None and name.startswith(keep_head + "."):
            yield name, tensor
        elif name.startswith("model."):
            yield name, tensor
        else:
            yield "model." + name, tensor


class DecoderForEmbedding(nnx.Module):
    """`__call__(md, ops) -> hidden [T, D]` after the final norm."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.model = LlamaModel(cfg, dtype=dtype, rngs=rngs, mlp_for_layer=dense_mlp)

    def __call__(self, md, ops):
        return self.model(md, [None] * self.config.num_hidden_layers, ops)[0]

    @classmethod
    def adapt_checkpoint(cls, cfg: ModelConfig, tensors):
        return _under_model(tensors, None)


class DecoderForSequenceClassification(DecoderForEmbedding):
    """HF's *ForSequenceClassification: `score` (no bias) on the last token's hidden state."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.score = _linear(cfg.hidden_size, cfg.num_labels, False, dtype, rngs)

    def pooling_head(self, pooled_SD, ops):
        """The pooled rows -> float32 class logits [S, C]."""
        return ops.linear(self.score, pooled_SD).astype(jnp.float32)

    def token_head(self, hidden_TD, ops):
        """Every token's row -> float32 class logits [T, C] (token_classify)."""
        return self.pooling_head(hidden_TD, ops)

    @classmethod
    def adapt_checkpoint(cls, cfg: ModelConfig, tensors):
        return _under_model(tensors, "score")


__all__ = ["DecoderForEmbedding", "DecoderForSequenceClassification"]
