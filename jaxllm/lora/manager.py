"""The engine's LoRA manager (vLLM's LoRA model manager): one object beside the runner.

Owns what the engine holds for LoRA: the host LRU of loaded adapters (peft.LoRACache), the
step feature that keeps the device slots (feature.LoRAFeature), the admission check of a
request's adapter (loaded, hence fully checked, before the request is queued), and the
adapters the server knows by name (--lora-modules, /v1/load_lora_adapter). With
enable_lora=False it is `NoLoRA`: no feature (the step compiles as without LoRA) and a
request that names an adapter is a ValueError. Never decides which requests run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from jaxllm.lora.config import LoRAConfig, lora_config_of
from jaxllm.lora.feature import LoRAFeature, model_projections
from jaxllm.lora.peft import LoRACache, read_adapter_config
from jaxllm.lora.request import LoRARequest, lora_request_of, with_lora_request
from jaxllm.lora.scheduling import lora_requests_info
from jaxllm.metrics import Gauge
from jaxllm.models.dtype import DTYPES


class NoLoRA:
    """enable_lora=False."""

    config: LoRAConfig | None = None
    features: tuple = ()
    max_loras: int | None = None

    def check(self, params) -> None:
        lora = lora_request_of(params)
        if lora is not None:
            raise ValueError(f"lora_request {lora.lora_name!r} given, but LoRA is not "
                             "enabled: start the engine with enable_lora=True")

    def list_loras(self) -> list[LoRARequest]:
        return []

    def get_lora(self, lora_name: str) -> LoRARequest | None:
        return None

    def add_lora(self, lora: LoRARequest) -> None:
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: LoRA is not enabled (start the "
                         "engine with enable_lora=True, the server with --enable-lora)")

    def metrics(self, scheduler) -> list:
        """vLLM's lora_requests_info gauge (none without LoRA)."""
        return []


class LoRAManager(NoLoRA):
    def __init__(self, config: LoRAConfig, model, num_slots: int, model_dtype,
                 single_device: bool = False):
        self.config = config
        self.max_loras = config.max_loras
        dtype = model_dtype if config.lora_dtype == "auto" else DTYPES[config.lora_dtype]
        self.cache = LoRACache(model_projections(model), config.max_lora_rank,
                               config.max_cpu_loras)
        self.feature = LoRAFeature(config, self.cache, num_slots, dtype, single_device)
        self.features = (self.feature,)
        self._registered: dict[str, LoRARequest] = {}  # the server's adapters, by name
        self._lock = threading.Lock()

    def check(self, params) -> None:
        """Load (and so check) the adapter a request names, before it is queued."""
        lora = lora_request_of(params)
        if lora is not None:
            self.cache.get(lora)

    # ---- adapters known by name (the server) ---------------------------------------------

    def add_lora(self, lora: LoRARequest) -> None:
        """Register (and load, so check) an adapter; a ValueError if it is bad or its name or
        id is taken by another."""
        with self._lock:
            for known in self._registered.values():
                if known.lora_name == lora.lora_name or known.lora_int_id == lora.lora_int_id:
                    raise ValueError(f"LoRA adapter {lora.lora_name!r} (id "
                                     f"{lora.lora_int_id}) is already loaded")
        read_adapter_config(lora, self.config.max_lora_rank)
        self.cache.get(lora)
        with self._lock:
            self._registered[lora.lora_name] = lora

    def remove_lora(self, lora_name: str) -> LoRARequest:
        """Forget a registered adapter: new requests can no longer name it; requests already
        running with it finish with it (its device slot is reused once they have left)."""
        with self._lock:
            lora = self._registered.pop(lora_name, None)
        if lora is None:
            raise ValueError(f"The lora adapter '{lora_name}' cannot be found.")
        self.cache.remove(lora.lora_int_id)
        return lora

    def get_lora(self, lora_name: str) -> LoRARequest | None:
        return self._registered.get(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self._registered.values())

    def metrics(self, scheduler) -> list:
        """vLLM's lora_requests_info: the running and the waiting adapters' names (comma
        separated) and max_lora as labels, the time of the snapshot as the value."""
        running, waiting = lora_requests_info(scheduler.running, scheduler.waiting)
        return [Gauge("jaxllm:lora_requests_info",
                      {"max_lora": str(self.max_loras), "running_lora_adapters": ",".join(running),
                       "waiting_lora_adapters": ",".join(waiting)}, time.time())]

    def next_id(self) -> int:
        return max((lr.lora_int_id for lr in self._registered.values()), default=0) + 1


def make_lora_manager(engine_config, model, num_slots: int, model_dtype,
                      single_device: bool = False) -> NoLoRA:
    """single_device: the model is not split over a mesh (tensor parallelism)."""
    config = lora_config_of(engine_config)
    if config is None:
        return NoLoRA()
    return LoRAManager(config, model, num_slots, model_dtype, single_device)


def apply_lora_requests(params: Sequence, lora_request) -> list:
    """One SamplingParams per prompt, each carrying its adapter: `lora_request` is None, one
    LoRARequest for all, or a list of one per prompt (vLLM's rule)."""
    if lora_request is None:
        return list(params)
    if isinstance(lora_request, LoRARequest):
        return [with_lora_request(p, lora_request) for p in params]
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per "
                         f"prompt) or None, got {type(lora_request).__name__}")
    if len(lora_request) != len(params):
        raise ValueError(f"The lengths of prompts ({len(params)}) and lora_request "
                         f"({len(lora_request)}) must be the same.")
    return [with_lora_request(p, lr) for p, lr in zip(params, lora_request)]
