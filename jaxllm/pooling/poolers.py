"""Poolers: which rows of a step's hidden states become a sequence's one pooled row (on device),
and what a request's parameters do to that row afterwards (on the host).

Owns the three pooling types as small objects (mean, CLS = first token, last token), chosen
once per engine from PoolerConfig; the rows a step returns (PooledRows: one per prompt;
TokenRows: one per token, for the engine's token task); `check_params`, vLLM's rules for a
request's task (an embedding model supports "embed" and "token_embed", a classifier
"classify" and "token_classify"; an engine pools one of them, its PoolerConfig's
pooling_task) and parameters; and `finish`: matryoshka truncation then L2 normalization for
embeddings (vLLM's order), softmax or sigmoid for class logits, each over the last axis (of a
pooled row, or of every token's row). Never runs the model.

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

@dataclasses.dataclass(frozen=True)
class PooledRows:
    """A step's output for the sequence tasks: one row per prompt, the pooler's, through the
    model's pooling head if it has one (a classifier) -> float32 [S, O]."""

    pooler: object

    def __call__(self, model, hidden_TD, md: PoolingMetadata, ops):
        pooled_SD = self.pooler(hidden_TD, md)
        head = getattr(model, "pooling_head", None)
        out_SO = pooled_SD if head is None else head(pooled_SD.astype(hidden_TD.dtype), ops)
        return out_SO.astype(jnp.float32)

    @staticmethod
    def split(out_SO: np.ndarray, starts: list[int], lens: list[int]) -> list[np.ndarray]:
        return [out_SO[s] for s in range(len(lens))]


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """A step's output for the token tasks: every token's row, through the model's token head
    if it has one (vLLM's: the classifier alone, without BERT's [CLS] pooler) -> float32
    [T, O]."""

    def __call__(self, model, hidden_TD, md: PoolingMetadata, ops):
        head = getattr(model, "token_head", None)
        return (hidden_TD if head is None else head(hidden_TD, ops)).astype(jnp.float32)

    @staticmethod
    def split(out_TO: np.ndarray, starts: list[int], lens: list[int]) -> list[np.ndarray]:
        return [out_TO[start:start + n] for start, n in zip(starts, lens)]


def make_pooler(cfg: PoolerConfig):
    return POOLERS[cfg.pooling_type]()


def make_rows(cfg: PoolerConfig):
    """What the engine's step returns: every token's row for a token task, else the pooled
    row of each prompt."""
    return TokenRows() if cfg.per_token else PooledRows(make_pooler(cfg))


def supported_tasks(cfg: PoolerConfig) -> list[str]:
    """The tasks the model supports, as vLLM lists them (one per engine: pooling_task)."""
    return [f"token_{cfg.task}", cfg.task]


def check_params(cfg: PoolerConfig, params: PoolingParams, task: str) -> None:
    """A request's task and parameters against the engine: ValueError naming what is
    wrong, with vLLM's rules and advice."""
    if task in ("embed", "token_embed") and cfg.task != "embed":
        raise ValueError("Embedding API is not supported by this model. Try converting the "
                         "model using `--convert embed`.")
    if task in ("classify", "token_classify") and cfg.task != "classify":
        raise ValueError("Classification API is not supported by this model. Try converting "
                         "the model using `--convert classify`.")
    if task not in supported_tasks(cfg):
        raise ValueError(f"Unsupported task: {task!r} Supported tasks: {supported_tasks(cfg)}")
    if task != cfg.pooling_task:
        raise ValueError(f"this engine pools {cfg.pooling_task!r}; for {task!r}, try switching "
                         f"the model's pooling_task via pooler_config={{'task': {task!r}}}")
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
    """One float32 row [O] (a pooled prompt) or rows [n, O] (every token of one prompt) ->
    what the request gets back; each row is finished on its own."""
    if cfg.task == "embed":
        if params.dimensions is not None:
            row = row[..., :params.dimensions]
        normalize = cfg.normalize if params.normalize is None else params.normalize
        if normalize:  # torch's F.normalize eps
            row = row / np.maximum(np.linalg.norm(row, axis=-1, keepdims=True), 1e-12)
        return row
    if not params.applies_activation(cfg.use_activation):
        return row
    if cfg.activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-row))
    e = np.exp(row - row.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


__all__ = ["POOLERS", "PooledRows", "TokenRows", "check_params", "finish", "make_pooler",
           "make_rows", "supported_tasks"]
