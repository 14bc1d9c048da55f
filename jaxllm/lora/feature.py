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
index[slot_T] the adapter slot of each token, y_TN += (x_TK @ A[m_T, l]) @ B[m_T, l] for the
tokens with an adapter, in the tables' dtype, products accumulated in f32 (xa rounded to the
dtype, as peft does): on cpu without tensor parallelism by the C++ kernel, else by a
lax.switch of XLA dots (lora/apply.py, chosen once).
Which adapter sits in which slot is host state here: a slot is taken when a request with an
adapter not resident joins the batch (its tables' rows written whole: one upload each),
freed (kept resident, evicted least recently used first) when its last request leaves. The scheduler (jaxllm/lora/scheduling.py) keeps the distinct adapters
of the running requests <= M, so a slot is always free. Never decides which requests run.
"""

from __future__ import annotations

import collections

import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxllm.lora.apply import choose_apply
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

    def __init__(self, config: LoRAConfig, cache: LoRACache, num_slots: int, dtype,
                 single_device: bool = False):
        """single_device: no tensor parallelism (the C++ kernel may run, lora/apply.py)."""
        self.config, self.cache = config, cache
        self.apply = choose_apply(dtype, single_device)
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
        m_T = hooks.rows["lora.index"][hooks.slot_T]
        return self.apply(x_TK, y_TN, hooks.rows[f"lora.{name}.A"],
                          hooks.rows[f"lora.{name}.B"], m_T, layer, self.num_lora_slots)
