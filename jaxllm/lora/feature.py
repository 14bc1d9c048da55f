"""Batched multi-LoRA in the jitted step: a step feature (runner/step_features.py) at the
dense-layer point (`project`, models/hooks.py), and the device weight slots it reads.

Owns the device half of LoRA (vLLM's LoRA model manager, tpu-inference's lora_utils): per
target module t (q/k/v/o/gate/up/down) two weight tables, step inputs like any per-slot
table (runner/device_rows.py), so writing an adapter into a slot never recompiles:

    lora.t.A   [M + 1, L, K, R]    M = max_loras adapter slots; row M (the fill row) is all
    lora.t.B   [M + 1, L, R, N]    zeros: "no adapter". L layers, K in, N out, R max rank
                                   (an adapter of smaller rank is zero-padded: exact);
                                   B holds the scaling (alpha / r) already
    lora.index [S_max + 1] int32   per batch slot: its request's adapter slot (M: none)

At layer l's projection t, for the T packed rows (slot_T their batch slots), m_T =
index[slot_T] the adapter slot of each token, one of three branches (a `lax.switch` on m_T):

    no token has an adapter:   y_TN unchanged
    one adapter s (and base):  xa_TR = (x_TK @ A[s, l]) * (m_T == s)          rank R only
                               y_TN += xa_TR @ B[s, l]
    several adapters:          xa_TX = (x_TK @ A[:M, l] as [K, M*R]) * onehot(m_T)   X = M*R
                               y_TN += xa_TX @ B[:M, l] as [M*R, N]
                               two skinny GEMMs: the shrink against every slot at once,
                               each token keeping its own slot's R columns

in the tables' dtype, products accumulated in f32 (xa rounded to the dtype, as peft does).
Which adapter sits in which slot is host state here: a slot is taken when a request with an
adapter not resident joins the batch (its tables' rows written whole: one upload each),
freed (kept resident, evicted least recently used first) when its last request leaves. The scheduler (jaxllm/lora/scheduling.py) keeps the distinct adapters
of the running requests <= M, so a slot is always free. Never decides which requests run.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.peft import TARGET_MODULES, LoRACache, LoRAModel, Projection
from jaxllm.lora.request import lora_request_of
from jaxllm.models.sharding import partition_spec
from jaxllm.runner.device_rows import DeviceRows, row_buckets
from jaxllm.runner.step_features import StepFeature


def model_projections(model) -> dict[str, Projection]:
    """Module path ("model.layers.0.self_attn.q_proj") -> Projection, for every dense layer
    of `model` whose name is a LoRA target (the names PEFT keys its tensors by)."""
    out = {}
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear) and path and path[-1] in TARGET_MODULES:
            layer = next((p for p in path if isinstance(p, int)), None)
            if layer is not None:
                out[".".join(map(str, path))] = Projection(
                    path[-1], layer, module.in_features, module.out_features)
    return out


class LoRAFeature(StepFeature):
    name = "lora"

    def __init__(self, config: LoRAConfig, cache: LoRACache, num_slots: int, dtype):
        self.config, self.cache = config, cache
        M, R = config.max_loras, config.max_lora_rank
        self.num_lora_slots = M
        shapes: dict[str, tuple[int, int]] = {}
        layers: dict[str, int] = collections.Counter()
        for p in cache.projections.values():
            shapes[p.name] = (p.in_features, p.out_features)
            layers[p.name] = max(layers[p.name], p.layer + 1)
        # Split over the mesh as the layer they adapt (models/sharding.py): A by K where the
        # layer is row-parallel (o, down), B by N where it is column-parallel (q/k/v,
        # gate/up), so a device holds only the slice its shard multiplies.
        axes = {p.name: partition_spec(tuple(path.split(".")) + ("kernel",))
                for path, p in cache.projections.items()}
        self.tables: dict[str, tuple[DeviceRows, DeviceRows]] = {
            t: (DeviceRows(M, (layers[t], K, R), dtype, 0, row_buckets=(1,),
                           partition_spec=PartitionSpec(None, None, axes[t][0], None)),
                DeviceRows(M, (layers[t], R, N), dtype, 0, row_buckets=(1,),
                           partition_spec=PartitionSpec(None, None, None, axes[t][1])))
            for t, (K, N) in shapes.items()}
        self.index = DeviceRows(num_slots, (), np.int32, M, row_buckets=row_buckets(num_slots))
        # Host state: lora_int_id -> its adapter slot; the requests using each; free slots
        # in least-recently-used order (resident adapters stay until a slot is needed).
        self.slot_of: dict[int, int] = {}
        self.users: dict[int, set[str]] = collections.defaultdict(set)
        self.lora_of_req: dict[str, int] = {}
        self.free = collections.OrderedDict((s, None) for s in range(M))

    def slot_rows(self) -> dict[str, DeviceRows]:
        rows = {"lora.index": self.index}
        for t, (a, b) in self.tables.items():
            rows[f"lora.{t}.A"], rows[f"lora.{t}.B"] = a, b
        return rows

    # ---- host: requests join and leave ----------------------------------------------------

    def update_states(self, so, slot_of: dict[str, int]) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._release(req_id)
        for new in so.scheduled_new_reqs:
            lora = lora_request_of(new.sampling_params)
            slot = self.num_lora_slots if lora is None else self._acquire(lora, new.req_id)
            self.index.set_row(slot_of[new.req_id], slot)

    def _acquire(self, lora, req_id: str) -> int:
        lid = lora.lora_int_id
        if lid not in self.slot_of:
            if not self.free:
                raise RuntimeError(f"no free LoRA slot for adapter {lora.lora_name!r}: more "
                                   f"than max_loras={self.num_lora_slots} adapters running")
            slot = next(iter(self.free))  # least recently used
            for old, s in list(self.slot_of.items()):
                if s == slot:
                    del self.slot_of[old]
            self._write(slot, self.cache.get(lora))
            self.slot_of[lid] = slot
        slot = self.slot_of[lid]
        self.free.pop(slot, None)
        self.users[lid].add(req_id)
        self.lora_of_req[req_id] = lid
        return slot

    def _release(self, req_id: str) -> None:
        lid = self.lora_of_req.pop(req_id, None)
        if lid is None:
            return
        self.users[lid].discard(req_id)
        if not self.users[lid]:
            del self.users[lid]
            self.free[self.slot_of[lid]] = None  # most recently used: evicted last

    def evict(self, lora_int_id: int) -> None:
        """Forget a resident adapter that no request uses (unload): its slot is free and
        its weights are read again if it comes back."""
        if lora_int_id in self.users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use")
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free[slot] = None
            self.free.move_to_end(slot, last=False)

    def _write(self, slot: int, model: LoRAModel) -> None:
        # Whole rows, built in the table's dtype: one compare and one upload per table.
        for t, (a_table, b_table) in self.tables.items():
            A_1LKR = np.zeros((1, *a_table.row_shape), a_table.dtype)
            B_1LRN = np.zeros((1, *b_table.row_shape), b_table.dtype)
            for (name, layer), (A_KR, B_RN) in model.weights.items():
                if name == t:
                    A_1LKR[0, layer, :, :model.rank] = A_KR
                    B_1LRN[0, layer, :model.rank] = B_RN
            a_table.set_rows([slot], A_1LKR)
            b_table.set_rows([slot], B_1LRN)

    # ---- device: the dense-layer point ----------------------------------------------------

    def project(self, name, layer, x_TK, y_TN, hooks):
        if name not in self.tables or layer is None:
            return y_TN
        M = self.num_lora_slots
        A_MKR = hooks.rows[f"lora.{name}.A"][:, layer]
        B_MRN = hooks.rows[f"lora.{name}.B"][:, layer]
        m_T = hooks.rows["lora.index"][hooks.slot_T]
        x_TK = x_TK.astype(A_MKR.dtype)
        first = jnp.min(m_T)  # M: no token has an adapter
        alone = jnp.all((m_T == first) | (m_T == M))

        def add(d_TN):
            return (y_TN.astype(jnp.float32) + d_TN).astype(y_TN.dtype)

        def one_adapter():  # every token with an adapter has adapter slot `first`
            A_KR = jax.lax.dynamic_index_in_dim(A_MKR, first, 0, keepdims=False)
            B_RN = jax.lax.dynamic_index_in_dim(B_MRN, first, 0, keepdims=False)
            xa_TR = _dot(x_TK, A_KR).astype(A_KR.dtype) * (m_T == first)[:, None].astype(
                A_KR.dtype)
            return add(_dot(xa_TR, B_RN))

        def several():  # shrink against every slot at once, keep each token's own R columns
            _, K, R = A_MKR.shape
            A_KX = A_MKR[:M].transpose(1, 0, 2).reshape(K, M * R)
            B_XN = B_MRN[:M].reshape(M * R, -1)
            mask_TX = jnp.repeat(jax.nn.one_hot(m_T, M, dtype=A_KX.dtype), R, axis=1)
            return add(_dot(_dot(x_TK, A_KX).astype(A_KX.dtype) * mask_TX, B_XN))

        branch = jnp.where(first == M, 0, jnp.where(alone, 1, 2))
        return jax.lax.switch(branch, (lambda: y_TN, one_adapter, several))


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)
