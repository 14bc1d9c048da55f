"""PoolingRunner: the pooling sibling of runner/model_runner.py. Scheduled whole prompts in, one
pooled float32 row per prompt out (or, for a token task, one per token); no KV cache, no
sampler.

Owns packing a step's prompts into padded device arrays (PoolingMetadata), the jitted step
(model forward -> the engine's rows, poolers.py: PooledRows, the pooler then the model's
head if it has one; or TokenRows, every token through the model's token head) over
(graphdef, state), and its static shapes: the token buckets of runner/buckets.py (T powers
of two up to max_num_batched_tokens, S = min(T, max_num_seqs)), every one compiled at
start-up unless enforce_eager. Never sees a Request and never decides what runs
(jaxllm/pooling/scheduler.py).

Packed layout, blocks of 8 rows (attention.py), T = 16, S = 16 (3 prompts, placed first fit in
scheduled order: p2 does not fit block 0 after p0 and p1, and goes to block 1):

    rows       | p0: 5 tokens | p1: 3 | p2: 4   | padding 12..15 |
    seq_ids      0 0 0 0 0      1 1 1   2 2 2 2   16 16 16 16       (S: the padding segment)
    positions    0 1 2 3 4      0 1 2   0 1 2 3   0 0 0 0
    qsl          0 5 8 (p2 starts at row 8) ... unused entries 12 (S + 1 entries)

qsl[s] is each prompt's first row; a gap between prompts is padding, so the poolers read
qsl[s] (first row), qsl[s] + seq_lens[s] - 1 (last row) and seq_ids (mean), never
qsl[s + 1] as an end.

Letters: T tokens, S sequences, D model dim (or C classes after a head), O the output width.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.kernels.linear_methods import LinearMethod
from jaxllm.models.parallel import ParallelOps
from jaxllm.pooling.attention import BlockPacking, DenseAttention, PoolingMetadata, Tiling
from jaxllm.runner.buckets import BucketConfig

logger = logging.getLogger(__name__)
MIN_TOKEN_BUCKET = 16  # a pooled prompt has [CLS] and [SEP] at least; fewer compiles


@dataclasses.dataclass(frozen=True)
class PoolingInput:
    """One scheduled prompt, as the runner needs it."""

    token_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None = None


def make_pooling_step(graphdef, rows, causal: bool, linear_method: LinearMethod,
                      tiling: Tiling | None = None):
    """The jitted step: (state, md) -> float32 [S, O] (PooledRows) or [T, O] (TokenRows).
    Static: the model's graph, the rows it returns, bidirectional or causal attention and its
    tile (attention.py), the linear method the weights were processed for."""
    ops = ParallelOps(DenseAttention(causal, tiling), linear_method)

    @jax.jit
    def step(state, md: PoolingMetadata):
        model = nnx.merge(graphdef, state)
        return rows(model, model(md, ops), md, ops)

    return step


def process_weights_after_loading(model, method: LinearMethod) -> None:
    """Every dense weight in the form `method` multiplies (the C++ GEMM's packed panels on
    CPU), once; embedding tables stay as loaded (a pooling model has no LM head)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear):
            module.kernel = nnx.Param(method.process_weights_after_loading(module.kernel[...]))


class PoolingRunner:
    def __init__(self, model, rows, *, causal: bool, linear_method: LinearMethod,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 enforce_eager: bool = False):
        process_weights_after_loading(model, linear_method)
        self.graphdef, self.state = nnx.split(model)
        self.buckets = BucketConfig.create(max_num_batched_tokens, max_num_seqs, 1, False,
                                           min_tokens=min(MIN_TOKEN_BUCKET,
                                                          max_num_batched_tokens))
        self.tiling = Tiling.for_max_model_len(max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.rows = rows  # PooledRows or TokenRows (poolers.py)
        self._step = make_pooling_step(self.graphdef, rows, causal, linear_method,
                                       self.tiling)
        self.num_compiles = 0
        self._compiled: dict[int, object] = {}
        if not enforce_eager:
            for T in self.buckets.token_buckets:
                self._compile(T)

    def _compile(self, T: int):
        S = self.buckets.seqs_for(T)
        md = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          _pack([], T, S))
        self._compiled[T] = self._step.lower(self.state, md).compile()
        self.num_compiles += 1
        return self._compiled[T]

    def execute(self, inputs: list[PoolingInput]) -> list[np.ndarray]:
        """-> per prompt, in order: its float32 pooled (and headed) row [O], or, for
        TokenRows, its tokens' rows [n, O]."""
        packing = BlockPacking.for_budget(self.tiling, self.max_num_batched_tokens)
        starts = [packing.add(len(p.token_ids)) for p in inputs]
        if None in starts:
            raise ValueError("the scheduled prompts do not fit the step's blocks "
                             "(PoolingScheduler admits only prompts that fit)")
        T = self.buckets.pad(max(packing.end(), 1), len(inputs), 1)[0]
        S = self.buckets.seqs_for(T)
        fn = self._compiled.get(T) or self._compile(T)
        out = np.asarray(jax.device_get(fn(self.state, _pack(inputs, T, S, starts))))
        return self.rows.split(out, starts, [len(p.token_ids) for p in inputs])


def _pack(inputs: list[PoolingInput], T: int, S: int,
          starts: list[int] | None = None) -> PoolingMetadata:
    """Each prompt's rows from its start (BlockPacking's; None: one after another)."""
    ids = np.zeros(T, np.int32)
    types = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    seq_ids = np.full(T, S, np.int32)
    qsl = np.zeros(S + 1, np.int32)
    seq_lens = np.zeros(S, np.int32)
    start = 0
    for s, p in enumerate(inputs):
        n = len(p.token_ids)
        start = start if starts is None else starts[s]
        ids[start:start + n] = p.token_ids
        if p.token_type_ids is not None:
            types[start:start + n] = p.token_type_ids
        positions[start:start + n] = np.arange(n)
        seq_ids[start:start + n] = s
        seq_lens[s] = n
        qsl[s] = start
        start += n
    qsl[len(inputs):] = start
    return PoolingMetadata(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(types),
                           jnp.asarray(seq_ids), jnp.asarray(qsl), jnp.asarray(seq_lens))


__all__ = ["PoolingInput", "PoolingRunner", "make_pooling_step"]
