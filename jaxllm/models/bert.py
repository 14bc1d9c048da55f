"""The BERT encoder family: BertModel (sentence embeddings) and BertForSequenceClassification
(cross-encoders), over the shared layers.

Owns the network and its checkpoint names. BERT differs from the decoders in flags that
models/layers.py already reads (learned absolute positions, LayerNorm with bias, biases on
every projection, GELU) plus three things of its own: token-type embeddings, a LayerNorm on
the embeddings, and post-LayerNorm residuals (`x = LN(x + f(x))`). Attention is the shared
`Attention`; which tokens it sees is the step's choice (`ops.attention`: bidirectional in a
pooling step, jaxllm/pooling/attention.py). Never holds a KV cache and never pools: the
pooling runner picks the rows (jaxllm/pooling/poolers.py).

Letters: T tokens, D model dim, S sequences, C classes.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
from flax import nnx

from jaxllm.models.config import ModelConfig
from jaxllm.models.layers import Attention, DenseMLP, LayerNorm, _linear


class BertEmbeddings(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        D = cfg.hidden_size
        embed = lambda n: nnx.Embed(n, D, dtype=dtype, param_dtype=dtype, rngs=rngs)  # noqa: E731
        self.word_embeddings = embed(cfg.vocab_size)
        self.position_embeddings = embed(cfg.max_position_embeddings)
        self.token_type_embeddings = embed(cfg.type_vocab_size)
        self.LayerNorm = LayerNorm(D, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, md):
        x_TD = (self.word_embeddings(md.input_ids) + self.position_embeddings(md.positions)
                + self.token_type_embeddings(md.token_type_ids))
        return self.LayerNorm(x_TD)


class BertLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, layer: int):
        self.attention = Attention(cfg, dtype=dtype, rngs=rngs, layer=layer)
        self.attention_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = DenseMLP(cfg, dtype=dtype, rngs=rngs)
        self.output_norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x_TD, md, ops, i: int):
        h_TD, _ = self.attention(x_TD, None, md, ops, layer=i)
        x_TD = self.attention_norm(x_TD + h_TD)
        return self.output_norm(x_TD + self.mlp(x_TD, ops))


class BertEncoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.layer = nnx.List([BertLayer(cfg, dtype=dtype, rngs=rngs, layer=i)
                               for i in range(cfg.num_hidden_layers)])


class BertPooler(nnx.Module):
    """HF's BertPooler: tanh(dense(first token)); only classification heads read it."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.dense = _linear(cfg.hidden_size, cfg.hidden_size, True, dtype, rngs)

    def __call__(self, x_SD, ops):
        return jnp.tanh(ops.linear(self.dense, x_SD).astype(jnp.float32)).astype(x_SD.dtype)


# HF's names inside a layer -> ours (models/layers.py's Attention and DenseMLP).
_LAYER_NAMES = {
    "attention.self.query": "attention.q_proj", "attention.self.key": "attention.k_proj",
    "attention.self.value": "attention.v_proj", "attention.output.dense": "attention.o_proj",
    "attention.output.LayerNorm": "attention_norm", "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2", "output.LayerNorm": "output_norm",
}
_LAYER = re.compile(r"^(.*encoder\.layer\.\d+\.)(.+)\.(weight|bias|gamma|beta)$")
_LEAF = {"gamma": "weight", "beta": "bias"}  # old TF-converted LayerNorms


def _rename(name: str) -> str:
    m = _LAYER.match(name)
    if m is None:
        return name
    prefix, inner, leaf = m.groups()
    return f"{prefix}{_LAYER_NAMES.get(inner, inner)}.{_LEAF.get(leaf, leaf)}"


class BertModel(nnx.Module):
    """The encoder; `__call__(md, ops) -> hidden [T, D]` after the last layer's norm."""

    bidirectional = True  # the pooling step's attention sees the whole prompt

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 add_pooling_layer: bool = False):
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = BertEncoder(cfg, dtype=dtype, rngs=rngs)
        self.pooler = BertPooler(cfg, dtype=dtype, rngs=rngs) if add_pooling_layer else None

    def __call__(self, md, ops):
        x_TD = self.embeddings(md)
        for i, layer in enumerate(self.encoder.layer):
            x_TD = layer(x_TD, md, ops, i)
        return x_TD

    @classmethod
    def adapt_checkpoint(cls, cfg: ModelConfig, tensors):
        """HF names -> ours; the position-id buffer and (for embeddings, which never read it)
        HF's pooler are dropped."""
        for name, tensor in tensors:
            if name.endswith("embeddings.position_ids") or name.startswith("pooler."):
                continue
            yield _rename(name), tensor


class BertForSequenceClassification(nnx.Module):
    """BERT, its pooler on the first token ([CLS]), then a linear classifier -> [S, C]."""

    bidirectional = True

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.bert = BertModel(cfg, dtype=dtype, rngs=rngs, add_pooling_layer=True)
        self.classifier = _linear(cfg.hidden_size, cfg.num_labels, True, dtype, rngs)

    def __call__(self, md, ops):
        return self.bert(md, ops)

    def pooling_head(self, pooled_SD, ops):
        """The pooled rows (CLS) -> float32 class logits [S, C]."""
        return ops.linear(self.classifier, self.bert.pooler(pooled_SD, ops)).astype(jnp.float32)

    def token_head(self, hidden_TD, ops):
        """Every token's row -> float32 class logits [T, C]: the classifier alone (vLLM's
        token_classify does not run BERT's [CLS] pooler)."""
        return ops.linear(self.classifier, hidden_TD).astype(jnp.float32)

    @classmethod
    def adapt_checkpoint(cls, cfg: ModelConfig, tensors):
        for name, tensor in tensors:
            if not name.endswith("embeddings.position_ids"):
                yield _rename(name), tensor


__all__ = ["BertForSequenceClassification", "BertModel"]
