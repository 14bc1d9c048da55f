"""The runner's jitted step lowered for a model layout and a mesh, with nothing allocated.

Owns: building the step's abstract arguments exactly as `ModelRunner` passes them (the
model in its tensor-parallel layout, KV caches split over KV heads, replicated host inputs)
from a checkpoint config, so that tools can compile the step for any mesh: host CPU devices
in tests, a deviceless 8-GPU topology in benchmarks/tp_plan.py. Never runs a step and never
reads weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.kernels.backends import AttentionBackend, AttentionLayer
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import kv_cache_shape
from jaxllm.models.parallel import ParallelOps
from jaxllm.models.sharding import Placement, kv_cache_sharding
from jaxllm.models.weights import abstract_model_state
from jaxllm.runner.step import abstract_inputs, make_step_fn


@dataclasses.dataclass(frozen=True)
class AbstractStep:
    model_config: ModelConfig  # the layout's (KV heads replicated, vocab padded)
    state: object  # the model's parameters, ShapeDtypeStructs with their shardings
    kv_caches: list  # [(k, v)] per layer, ShapeDtypeStructs with their shardings
    token_ids: jax.ShapeDtypeStruct  # [R, L] token history
    lowered: object  # jax Lowered; .compile() it (gpu_compile.compile_lowered for a GPU)


def lower_abstract_step(cfg: ModelConfig, mesh, backend: AttentionBackend, *, T: int, S: int,
                        W: int, num_blocks: int, block_size: int = 16, dtype=jnp.bfloat16,
                        max_num_seqs: int = 8, max_model_len: int | None = None
                        ) -> AbstractStep:
    """Lower the step of bucket (T, S, W) for `cfg` laid out over `mesh`."""
    placement = Placement(mesh)
    graphdef, state = abstract_model_state(cfg, dtype, placement)
    mcfg = placement.layout(cfg).model_config
    cache = jax.ShapeDtypeStruct(kv_cache_shape(mcfg, num_blocks, block_size),
                                 backend.kv_storage_dtype(dtype), sharding=kv_cache_sharding(mesh))
    kv_caches = [(cache, cache) for _ in range(mcfg.num_hidden_layers)]
    rep = NamedSharding(mesh, PartitionSpec())
    token_ids = jax.ShapeDtypeStruct((max_num_seqs, max_model_len or W * block_size),
                                     jnp.int32, sharding=rep)
    step = make_step_fn(graphdef, ParallelOps(AttentionLayer(backend, mesh)))
    lowered = step.trace(state, kv_caches, token_ids,
                         *abstract_inputs(T, S, W, rep, cfg.vocab_size)).lower()
    return AbstractStep(mcfg, state, kv_caches, token_ids, lowered)
