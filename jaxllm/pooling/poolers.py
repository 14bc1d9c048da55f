"""Poolers: which rows of a step's hidden states become a sequence's one pooled row (on device),
and what a request's parameters do to that row afterwards (on the host).

Owns the three pooling types as small objects (mean, CLS = first token, last token), chosen
once per engine from PoolerConfig, and `finish`: matryoshka truncation then L2 normalization
for embeddings (vLLM's order), softmax or sigmoid for class logits. Never runs the model.

Letters: T packed tokens, S sequences, D model dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.pooling.attention import PoolingMetadata
from jaxllm.pooling.config import PoolerConfig
from jaxllm.pooling.params import PoolingParams


@dataclasses.dataclass(frozen=True)
class MeanPool:
    """The mean of each sequence's rows, summed in float32."""

    def __call__(self, hidden_TD, md: PoolingMetadata):
        S = md.seq_lens.shape[0]
        sum_SD = jax.ops.segment_sum(hidden_TD.astype(jnp.float32), md.seq_ids,
                                     num_segments=S + 1)[:S]  # segment S: padding rows
        return sum_SD / jnp.maximum(md.seq_lens, 1).astype(jnp.float32)[:, None]


@dataclasses.dataclass(frozen=True)
class FirstTokenPool:
    """The first row of each sequence (BERT's [CLS])."""

    def __call__(self, hidden_TD, md: PoolingMetadata):
        return jnp.take(hidden_TD, md.query_start_loc[:-1], axis=0, mode="clip")


@dataclasses.dataclass(frozen=True)
class LastTokenPool:
    """The last row of each sequence (decoders: the only one that has read them all)."""

    def __call__(self, hidden_TD, md: PoolingMetadata):
        # (rows between prompts may be padding: the end is the start plus the length)
        last_S = md.query_start_loc[:-1] + md.seq_lens - 1
        return jnp.take(hidden_TD, last_S, axis=0, mode="clip")


POOLERS = {"MEAN": MeanPool, "CLS": FirstTokenPool, "LAST": LastTokenPool}


def make_pooler(cfg: PoolerConfig):
    return POOLERS[cfg.pooling_type]()


def check_params(cfg: PoolerConfig, params: PoolingParams, task: str) -> None:
    """A request's parameters against the model: ValueError naming what is wrong."""
    if task not in (cfg.task, "encode"):
        raise ValueError(f"this model serves the {cfg.task!r} task, not {task!r}")
    if params.dimensions is not None:
        if cfg.task != "embed":
            raise ValueError("dimensions applies to embedding models only")
        if not cfg.is_matryoshka:
            raise ValueError("Model does not support matryoshka representation, changing "
                             "output dimensions will lead to poor results.")
        if cfg.matryoshka_dimensions and params.dimensions not in cfg.matryoshka_dimensions:
            raise ValueError(f"Model only supports {list(cfg.matryoshka_dimensions)} "
                             f"matryoshka dimensions, use other output dimensions will lead "
                             f"to poor results.")


def finish(cfg: PoolerConfig, row: np.ndarray, params: PoolingParams) -> np.ndarray:
    """One pooled float32 row -> what the request gets back."""
    if cfg.task == "embed":
        if params.dimensions is not None:
            row = row[:params.dimensions]
        normalize = cfg.normalize if params.normalize is None else params.normalize
        if normalize:
            row = row / max(float(np.linalg.norm(row)), 1e-12)  # torch's F.normalize eps
        return row
    if not params.applies_activation():
        return row
    if cfg.activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-row))
    e = np.exp(row - row.max())
    return e / e.sum()


__all__ = ["POOLERS", "check_params", "finish", "make_pooler"]
