"""The scheduler's LoRA rule (vLLM's): at most max_loras distinct adapters among the running
requests, so every step's adapters fit the device slots (jaxllm/lora/feature.py). A waiting
request whose adapter would be one too many is stepped over and keeps its place; it runs
once a running adapter's requests finish. Never drops a request.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxllm.lora.request import lora_request_of


def admits_lora(request, running: Iterable, max_loras: int | None) -> bool:
    """May `request` join `running` without exceeding max_loras adapters (None: no LoRA)?"""
    lora = lora_request_of(request.sampling_params)
    if lora is None or max_loras is None:
        return True
    active = {lr.lora_int_id for lr in (lora_request_of(r.sampling_params) for r in running)
              if lr is not None}
    return lora.lora_int_id in active or len(active) < max_loras


def lora_requests_info(running: Iterable, waiting: Iterable) -> tuple[list[str], list[str]]:
    """(running adapter names, waiting adapter names), sorted: vLLM's lora_requests_info."""
    def names(requests):
        return sorted({lr.lora_name for lr in (lora_request_of(r.sampling_params)
                                               for r in requests) if lr is not None})
    return names(running), names(waiting)
