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

At layer l's projection t, for the T packed rows (slot_T their batch slots):

    m_T    = index[slot_T]                                   adapter slot of each token
    xa_TMR = einsum(x_TK, A[:, l]) * onehot(m_T)[:, :, None]   shrink, every slot at once
    y_TN  += einsum(xa_TMR, B[:, l])                         expand (f32 accumulation)

under a `lax.cond` that skips both when no token of the step has an adapter. Which adapter
sits in which slot is host state here: a slot is taken when a request with an adapter not
resident joins the batch, freed (kept resident, evicted least recently used first) when its
last request leaves. The scheduler (jaxllm/lora/scheduling.py) keeps the distinct adapters
of the running requests <= M, so a slot is always free. Never decides which requests run.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.peft import TARGET_MODULES, LoRACache, LoRAModel, Projection
from jaxllm.lora.request import lora_request_of
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
        self.tables: dict[str, tuple[DeviceRows, DeviceRows]] = {
            t: (DeviceRows(M, (layers[t], K, R), dtype, 0, row_buckets=(1,)),
                DeviceRows(M, (layers[t], R, N), dtype, 0, row_buckets=(1,)))
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
        for t, (a_table, b_table) in self.tables.items():
            A_LKR = np.zeros(a_table.row_shape, np.float32)
            B_LRN = np.zeros(b_table.row_shape, np.float32)
            for (name, layer), (A_KR, B_RN) in model.weights.items():
                if name == t:
                    A_LKR[layer, :, :model.rank] = A_KR
                    B_LRN[layer, :model.rank] = B_RN
            a_table.set_row(slot, A_LKR)
            b_table.set_row(slot, B_LRN)

    # ---- device: the dense-layer point ----------------------------------------------------

    def project(self, name, layer, x_TK, y_TN, hooks):
        if name not in self.tables or layer is None:
            return y_TN
        M = self.num_lora_slots
        A_MKR = hooks.rows[f"lora.{name}.A"][:, layer]
        B_MRN = hooks.rows[f"lora.{name}.B"][:, layer]
        m_T = hooks.rows["lora.index"][hooks.slot_T]

        def with_lora():
            onehot_TM = jax.nn.one_hot(m_T, M + 1, dtype=jnp.float32)
            xa_TMR = jnp.einsum("tk,mkr->tmr", x_TK.astype(A_MKR.dtype), A_MKR,
                                preferred_element_type=jnp.float32) * onehot_TM[:, :, None]
            d_TN = jnp.einsum("tmr,mrn->tn", xa_TMR.astype(B_MRN.dtype), B_MRN,
                              preferred_element_type=jnp.float32)
            return (y_TN.astype(jnp.float32) + d_TN).astype(y_TN.dtype)

        return jax.lax.cond(jnp.any(m_T != M), with_lora, lambda: y_TN)
