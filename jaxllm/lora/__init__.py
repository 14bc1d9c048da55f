"""LoRA adapters (vLLM's `vllm.lora`): requests, PEFT loading, the batched step feature and
the scheduling rule. `from jaxllm.lora.request import LoRARequest`, as in vLLM."""

from jaxllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
