"""PEFT LoRA directories (adapter_config.json + adapter_model.safetensors) as numpy weights.

Owns reading and checking one adapter against the model's projections: which module each
tensor belongs to, its rank against max_lora_rank, the scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora) folded into B, and the fused forms (qkv_proj,
gate_up_proj: one A, B split by rows into the model's q/k/v and gate/up). Also the host LRU
of loaded adapters (max_cpu_loras). Every refusal is a ValueError naming the adapter and
the field. Never touches a device.

Shapes: A_KR [in K, rank R] (PEFT's lora_A.weight transposed), B_RN [R, out N] (lora_B
transposed, times the scaling).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import threading
import time

import numpy as np

from jaxllm.lora.request import LoRARequest
from jaxllm.models.safetensors_io import iter_tensors

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                  "down_proj")
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"^(?:base_model\.model\.)?(.*)\.(lora_A|lora_B)(?:\.default)?\.weight$")


@dataclasses.dataclass(frozen=True)
class Projection:
    """A dense layer of the model that an adapter may target."""

    name: str  # "q_proj", ...
    layer: int
    in_features: int
    out_features: int


@dataclasses.dataclass(frozen=True)
class LoRAModel:
    """One loaded adapter: (module name, layer) -> (A_KR, B_RN scaled), float32."""

    lora_int_id: int
    lora_name: str
    rank: int
    weights: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]


def read_adapter_config(lora: LoRARequest, max_lora_rank: int) -> dict:
    path = os.path.join(lora.lora_path, "adapter_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: no adapter_config.json in "
                         f"lora_path {lora.lora_path!r}")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: adapter_config.json does not "
                         f"parse: {e}") from None
    bad = lambda field, msg: ValueError(  # noqa: E731
        f"LoRA adapter {lora.lora_name!r}: {field} {msg}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"must be 'LORA', got {cfg.get('peft_type')!r}")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise bad("r", f"must be an int >= 1, got {r!r}")
    if r > max_lora_rank:
        raise bad("r", f"({r}) is greater than max_lora_rank ({max_lora_rank})")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise bad("rank_pattern/alpha_pattern", "are not supported (one rank per adapter)")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", f"must be 'none', got {cfg.get('bias')!r}")
    if cfg.get("modules_to_save"):
        raise bad("modules_to_save", f"is not supported, got {cfg.get('modules_to_save')}")
    if cfg.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out", "is not supported")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGET_MODULES and t not in FUSED_MODULES]
        if unknown:
            raise bad("target_modules", f"contains {unknown}; supported: "
                      f"{list(TARGET_MODULES) + list(FUSED_MODULES)}")
    return cfg


def load_lora_model(lora: LoRARequest, projections: dict[str, Projection],
                    max_lora_rank: int) -> LoRAModel:
    """Read and check `lora`'s directory against the model's `projections` (module path,
    e.g. "model.layers.0.self_attn.q_proj" -> Projection)."""
    cfg = read_adapter_config(lora, max_lora_rank)
    r = cfg["r"]
    alpha = cfg.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    st = os.path.join(lora.lora_path, "adapter_model.safetensors")
    if not os.path.isfile(st):
        binary = os.path.isfile(os.path.join(lora.lora_path, "adapter_model.bin"))
        raise ValueError(
            f"LoRA adapter {lora.lora_name!r}: no adapter_model.safetensors in lora_path "
            f"{lora.lora_path!r}" + ("; adapter_model.bin (a torch pickle) cannot be read "
                                     "without torch: convert it with safetensors" if binary
                                     else ""))
    pairs: dict[str, dict[str, np.ndarray]] = collections.defaultdict(dict)
    for key, tensor in iter_tensors(st):
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: tensor {key!r} is not a "
                             "lora_A/lora_B weight")
        pairs[m.group(1)][m.group(2)] = tensor.astype(np.float32)
    weights = {}
    for module, ab in pairs.items():
        leaf = module.rsplit(".", 1)[-1]
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: module {module!r} has only "
                             f"{sorted(ab)}")
        A_RK, B_NR = ab["lora_A"], ab["lora_B"]
        if A_RK.shape[0] != r or B_NR.shape[1] != r:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: module {module!r} has rank "
                             f"{A_RK.shape[0]}, but r is {r}")
        prefix = module[: -len(leaf)]
        parts = FUSED_MODULES.get(leaf, (leaf,))
        targets = [projections.get(prefix + p) for p in parts]
        if leaf not in TARGET_MODULES and leaf not in FUSED_MODULES or None in targets:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: target module {module!r} is "
                             "not a projection of this model; supported: "
                             f"{list(TARGET_MODULES) + list(FUSED_MODULES)}")
        outs = [t.out_features for t in targets]
        if A_RK.shape[1] != targets[0].in_features or B_NR.shape[0] != sum(outs):
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: module {module!r} has lora_A "
                f"{A_RK.shape} and lora_B {B_NR.shape}; the model's layer takes "
                f"{targets[0].in_features} inputs and gives {sum(outs)} outputs")
        for t, B_nR in zip(targets, np.split(B_NR, np.cumsum(outs)[:-1], axis=0)):
            weights[(t.name, t.layer)] = (np.ascontiguousarray(A_RK.T),
                                          np.ascontiguousarray(B_nR.T * scaling))
    if not weights:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: adapter_model.safetensors holds "
                         "no lora_A/lora_B weights")
    return LoRAModel(lora.lora_int_id, lora.lora_name, r, weights)


class LoRACache:
    """The adapters loaded in host memory, least recently used evicted past capacity
    (max_cpu_loras), keyed by lora_int_id. Thread-safe: the front end checks (and loads)
    at admission, the runner reads at the step."""

    def __init__(self, projections: dict[str, Projection], max_lora_rank: int,
                 capacity: int):
        self.projections = projections
        self.max_lora_rank = max_lora_rank
        self.capacity = capacity
        self._models: collections.OrderedDict[int, LoRAModel] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.load_seconds: list[float] = []  # how long each load took (benchmarks)

    def get(self, lora: LoRARequest) -> LoRAModel:
        with self._lock:
            model = self._models.get(lora.lora_int_id)
            if model is not None:
                self._models.move_to_end(lora.lora_int_id)
                return model
        t0 = time.perf_counter()
        model = load_lora_model(lora, self.projections, self.max_lora_rank)
        with self._lock:
            self.load_seconds.append(time.perf_counter() - t0)
            self._models[lora.lora_int_id] = model
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)
        return model

    def remove(self, lora_int_id: int) -> None:
        with self._lock:
            self._models.pop(lora_int_id, None)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._models
