"""Tensor parallelism through jax sharding: logical axis names per parameter, and a mesh rule.

Owns the explicit partition map (parameter path -> logical axes) and the rule from logical
axes to mesh axes, and `Placement`: a mesh with the checkpoint layout it implies
(models/tp_layout.py), which the loaders take. Dense layers are left to XLA's SPMD
partitioner; what it cannot see through (attention kernels, the embedding lookup, the LM
head) runs per shard (kernels/backends.py, models/parallel.py).

Megatron layout on a mesh axis "tp": q/k/v and gate/up split by output columns (heads, mlp),
o_proj and down_proj by input rows, so each layer needs one all-reduce after attention and
one after the MLP. The vocabulary is split for the embedding and the LM head.
"""

from __future__ import annotations

import dataclasses
import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.kernels.backends import TP_AXIS
from jaxllm.models.config import ModelConfig
from jaxllm.models.tp_layout import TensorParallelLayout

# (regex on the dotted parameter path, logical axes of the parameter's dims)
LOGICAL_AXES: list[tuple[str, tuple[str | None, ...]]] = [
    (r"embed_tokens\.embedding$", ("vocab", "embed")),
    (r"self_attn\.[qkv]_proj\.kernel$", ("embed", "heads")),
    (r"self_attn\.[qkv]_proj\.bias$", ("heads",)),
    (r"self_attn\.o_proj\.kernel$", ("heads", "embed")),
    (r"self_attn\.o_proj\.bias$", ("embed",)),
    (r"mlp\.(gate|up)_proj\.kernel$", ("embed", "mlp")),
    (r"mlp\.down_proj\.kernel$", ("mlp", "embed")),
    # Mixture of experts (models/moe.py): each expert split like a dense MLP; the router
    # and the shared-expert gate (a handful of columns) are replicated.
    (r"mlp\.experts\.gate_up_proj$", ("expert", "embed", None, "mlp")),
    (r"mlp\.experts\.down_proj$", ("expert", "mlp", "embed")),
    (r"mlp\.shared_expert\.(gate|up)_proj\.kernel$", ("embed", "mlp")),
    (r"mlp\.shared_expert\.down_proj\.kernel$", ("mlp", "embed")),
    (r"mlp\.(gate|shared_expert_gate)\.kernel$", ("embed", None)),
    (r"(norm|layernorm)\.weight$", ("norm",)),
    (r"^lm_head\.kernel$", ("embed", "vocab")),
]

# Logical axis -> mesh axis (None: replicated).
# No expert parallelism: every device holds every expert's slice ("expert" replicated).
TP_RULES: dict[str, str | None] = {"vocab": TP_AXIS, "heads": TP_AXIS, "mlp": TP_AXIS,
                                   "embed": None, "norm": None, "expert": None}


def logical_axes(path: tuple) -> tuple[str | None, ...]:
    dotted = ".".join(str(p) for p in path)
    for pattern, axes in LOGICAL_AXES:
        if re.search(pattern, dotted):
            return axes
    raise KeyError(f"no logical axes for parameter {dotted!r}; add it to LOGICAL_AXES")


def partition_spec(path: tuple, rules: dict[str, str | None] = TP_RULES) -> PartitionSpec:
    return PartitionSpec(*(rules.get(a) if a else None for a in logical_axes(path)))


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A 1-D "tp" mesh over `devices` (default: the first tensor_parallel_size visible ones).
    The engine always has one, of 1 device without tensor parallelism, so that every array
    it places lands on its own devices (data-parallel replicas each own a slice)."""
    pool = jax.devices() if devices is None else list(devices)
    devices = pool[:tensor_parallel_size]
    if len(devices) < tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but only "
                         f"{len(pool)} devices are available")
    # Auto axes: XLA's SPMD partitioner propagates shardings through the model, which never
    # annotates its intermediates (explicit axes would ask every gather for an out_sharding).
    return jax.make_mesh((tensor_parallel_size,), (TP_AXIS,), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a checkpoint's parameters go (`load_params(..., placement=...)`)."""

    mesh: Mesh

    def layout(self, cfg: ModelConfig) -> TensorParallelLayout:
        return TensorParallelLayout.create(cfg, self.mesh.size)

    def sharding(self, path: tuple) -> NamedSharding:
        return NamedSharding(self.mesh, partition_spec(path))


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """KV caches [num_blocks, block_size, K, H] split over KV heads (the layout makes K a
    multiple of the mesh size)."""
    return NamedSharding(mesh, PartitionSpec(None, None, TP_AXIS, None))
