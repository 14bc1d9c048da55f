"""What a model step runs per shard: attention, the embedding lookup, the LM head, and the
dense matmuls (those whose input is split over devices among them).

Owns: `ParallelOps`, the one object a model's forward receives for everything that must not
be left to XLA's SPMD partitioner, and the linear method (kernels/linear_methods.py) that
multiplies the dense weights in the form it left them in after loading. The partitioner
handles the dense layers well (Megatron layout, models/sharding.py: one all-reduce after
attention, one after the MLP), but it cannot see into an attention kernel
(kernels/backends.py runs those per shard), and for a lookup into a vocabulary-split table
it gathered the whole table onto every device. Here:

    embed:   device d holds rows [d*V/tp, (d+1)*V/tp) of the table; it looks up the ids in
             its range, zeros for the rest, and one all-reduce [T, D] sums the devices.
    logits:  hidden [S, D] (whole) @ its columns of the LM head -> [S, V/tp] on each
             device; one all-gather of those activations gives the sampler whole rows
             [S, V] (padded vocab columns dropped).
    row-parallel matmuls (o_proj, down_proj: input split over devices): each device
             multiplies its columns of x by its rows of the kernel (f32 accumulation),
             rounds to the compute dtype, and one all-reduce sums in that dtype, as vLLM's
             RowParallelLinear does. Left to the partitioner, the sum ran over the f32
             partial results: twice the bytes (measured, benchmarks/tp_plan.py).

    moe_experts (models/moe.py): the linear method's expert FFN (the C++ grouped GEMM for
             "cpu", XLA's block-sparse loop for "xla"). Under a mesh (always "xla")
             each device runs the chosen experts' FFNs on its F/tp
             columns of gate/up and rows of down (a dense MLP's layout, per expert), on
             the whole routed batch; one all-reduce [T, D] sums the devices, in the
             compute dtype.

Every dense layer's output passes `hooks.project` (the step's features, e.g. LoRA; the
identity without). With a mesh of one device (or none) each op is the plain unsharded one, through the linear
method. Never holds state and never decides a layout (models/tp_layout.py does); under a mesh
the linear method is "xla" (the partitioner's layout), anything else is a ValueError.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.kernels.backends import TP_AXIS, AttentionLayer, get_backend
from jaxllm.kernels.linear_methods import LinearMethod, get_linear_method
from jaxllm.models.hooks import NO_HOOKS, StepHooks


@dataclasses.dataclass(frozen=True)
class ParallelOps:
    attention: AttentionLayer
    # How the dense weights are stored and multiplied; the model's weights must have been
    # through its process_weights_after_loading (LlamaForCausalLM does it).
    linear_method: LinearMethod = dataclasses.field(
        default_factory=lambda: get_linear_method("xla"))
    # The step's features at each dense layer (StepHooks.project; the step sets them per
    # trace): with none, every linear is the plain one.
    hooks: StepHooks = NO_HOOKS

    def __post_init__(self):
        if self._mesh is not None and self.linear_method.name != "xla":
            raise ValueError(f'linear method "{self.linear_method.name}" cannot run under '
                             "tensor parallelism: the partitioner lays the weights out")

    @classmethod
    def single_device(cls, backend: str = "xla", linear: str = "xla") -> "ParallelOps":
        """No mesh: the model as written, for tools and tests."""
        return cls(AttentionLayer(get_backend(backend)), get_linear_method(linear))

    @property
    def _mesh(self):
        mesh = self.attention.mesh
        return mesh if mesh is not None and mesh.size > 1 else None

    def linear(self, layer, x_TK):
        """A column-parallel (or unsharded) linear layer: XLA's partitioner splits it."""
        return self.hooks.project(layer, x_TK, self.linear_method.apply(layer, x_TK))

    def embed(self, table_VD, ids_T, features: int):
        """Rows of the embedding `table_VD` [V, D = features] at ids_T [T] -> [T, D] in the
        table's dtype (the table as the linear method stored it)."""
        if self._mesh is None:
            return self.linear_method.embed(table_VD, ids_T, features)

        def lookup(table_vD, ids_T):
            rows = table_vD.shape[0]
            local_T = ids_T - jax.lax.axis_index(TP_AXIS) * rows
            mine_T = (local_T >= 0) & (local_T < rows)
            x_TD = jnp.take(table_vD, jnp.clip(local_T, 0, rows - 1), axis=0)
            return jax.lax.psum(jnp.where(mine_T[:, None], x_TD, 0), TP_AXIS)

        return jax.shard_map(lookup, mesh=self._mesh, in_specs=(P(TP_AXIS, None), P()),
                             out_specs=P())(table_VD, ids_T)

    def logits(self, hidden_SD, w, *, spec: str, vocab_size: int):
        """hidden [S, D] against the LM head `w` (einsum spec "sd,vd->sv" for an embedding
        [V, D], "sd,dv->sv" for a kernel [D, V]) -> float32 [S, vocab_size], whole rows.
        The matmul runs in the weights' dtype with f32 accumulation."""
        def local(h_SD, w):
            return jnp.einsum(spec, h_SD, w, preferred_element_type=jnp.float32)

        if self._mesh is None:
            return self.linear_method.logits(hidden_SD, w, spec)[:, :vocab_size]
        vocab_axis = spec.split("->")[0].split(",")[1].index("v")
        w_spec = P(*(TP_AXIS if i == vocab_axis else None for i in range(2)))

        def gathered(h_SD, w):
            return jax.lax.all_gather(local(h_SD, w), TP_AXIS, axis=1, tiled=True)

        out = jax.shard_map(gathered, mesh=self._mesh, in_specs=(P(), w_spec),
                            out_specs=P(), check_vma=False)(hidden_SD, w)
        return out[:, :vocab_size]

    def moe_experts(self, x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD):
        """The linear method's expert_ffn(x, weights, ids, w_gate_up, w_down) -> float32
        [T, D] (models/moe.py), over the expert weights split by F -> [T, D] whole, in x's
        dtype."""
        expert_ffn = self.linear_method.expert_ffn
        if self._mesh is None:
            return expert_ffn(x_TD, weights_TK, ids_TK, w_gate_up_ED2F,
                              w_down_EFD).astype(x_TD.dtype)

        def partial_sum(*args):
            return jax.lax.psum(expert_ffn(*args).astype(x_TD.dtype), TP_AXIS)

        return jax.shard_map(partial_sum, mesh=self._mesh,
                             in_specs=(P(), P(), P(), P(None, None, None, TP_AXIS),
                                       P(None, TP_AXIS, None)),
                             out_specs=P(), check_vma=False)(
            x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD)

    def row_parallel(self, linear, x_TF):
        """`linear` (models/layers.py Linear, kernel [F, D] split over F) applied to x_TF
        [T, F] (split over F) -> [T, D] whole, in the layer's dtype; its bias is added once,
        after the sum."""
        if self._mesh is None:
            return self.linear(linear, x_TF)
        return self.hooks.project(linear, x_TF, self._row_parallel(linear, x_TF))

    def _row_parallel(self, linear, x_TF):

        def partial_sum(x_Tf, w_fD):
            y_TD = jnp.einsum("tf,fd->td", x_Tf, w_fD, preferred_element_type=jnp.float32)
            return jax.lax.psum(y_TD.astype(linear.dtype), TP_AXIS)

        y_TD = jax.shard_map(partial_sum, mesh=self._mesh,
                             in_specs=(P(None, TP_AXIS), P(TP_AXIS, None)),
                             out_specs=P())(x_TF, linear.kernel[...])
        if linear.bias is None:
            return y_TD
        return (y_TD.astype(jnp.float32) + linear.bias[...]).astype(linear.dtype)
