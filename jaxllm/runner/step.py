"""What is jitted, and with which static shapes.

Owns: the jitted model step (one compile per (T, S, W) bucket, the KV cache donated so it
is updated in place) and the prompt-logits helper (one compile per T bucket). Functions are
jitted once over (graphdef, state): `nnx.split` happens once at load, `nnx.merge` inside.
Every compile goes through `CompiledFunctions`, which counts them: serving after warm-up
must count zero.
"""

from __future__ import annotations

import threading
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.models.base import AttentionMetadata


def make_step_fn(graphdef, attention_backend: str, replicated=None):
    """`replicated`: with tensor parallelism, a replicated NamedSharding on the mesh; the
    outputs are gathered to it so the sampler (compiled for replicated inputs) takes them."""
    def step(state, kv_caches, md: AttentionMetadata, logits_indices_S):
        model = nnx.merge(graphdef, state)
        hidden_TD, kv_caches = model(md, kv_caches, attention_backend)
        logits_SV = model.compute_logits(hidden_TD[logits_indices_S])  # [S, V] f32
        if replicated is not None:
            logits_SV = jax.lax.with_sharding_constraint(logits_SV, replicated)
            hidden_TD = jax.lax.with_sharding_constraint(hidden_TD, replicated)
        return logits_SV, hidden_TD, kv_caches

    return jax.jit(step, donate_argnums=(1,))


def make_prompt_logits_fn(graphdef):
    def prompt_logits(state, hidden_TD):
        return nnx.merge(graphdef, state).compute_logits(hidden_TD)  # [T, V] f32

    return jax.jit(prompt_logits)


def abstract_metadata(T: int, S: int, W: int, sharding=None
                      ) -> tuple[AttentionMetadata, jax.ShapeDtypeStruct]:
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)  # noqa
    md = AttentionMetadata(input_ids=i32(T), positions=i32(T), slot_mapping=i32(T),
                           block_tables=i32(S, W), seq_lens=i32(S),
                           query_start_loc=i32(S + 1), num_seqs=i32())
    return md, i32(S)


class CompiledFunctions:
    """AOT-compiled executables keyed by their static shape; compiles on a miss and counts."""

    def __init__(self, jitted, abstract_args: Callable[..., tuple]):
        self._jitted = jitted
        self._abstract_args = abstract_args
        self._compiled: dict[tuple, object] = {}
        self._lock = threading.Lock()  # warm-up compiles from several threads
        self.num_compiles = 0

    def get(self, key: tuple):
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._jitted.lower(*self._abstract_args(*key)).compile()
            with self._lock:
                self._compiled[key] = fn
                self.num_compiles += 1
        return fn
