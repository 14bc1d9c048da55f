"""`LoRARequest`, the handle a user passes to select an adapter (vLLM's
`vllm.lora.request.LoRARequest`), and how it rides on a request.

Owns the request type and the one place a request's adapter is stored: its SamplingParams'
extra_args under `LORA_REQUEST_KEY` (the engine-private key convention of `_cache_salt` and
the research features), so the scheduler, the prefix cache and the runner all read it from
the params they already carry. Never loads weights (jaxllm/lora/peft.py does).
"""

from __future__ import annotations

import dataclasses

LORA_REQUEST_KEY = "_lora_request"


@dataclasses.dataclass(frozen=True, eq=False)
class LoRARequest:
    """lora_int_id: > 0 and unique per adapter (0 is the base model). Equal and hashed by
    lora_name, as vLLM's."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an int > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty path, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


def lora_request_of(params) -> LoRARequest | None:
    """The adapter a request's SamplingParams carry (None: the base model; extra_args that
    is no dict is the processor's error to report)."""
    extra = getattr(params, "extra_args", None)
    return extra.get(LORA_REQUEST_KEY) if isinstance(extra, dict) else None


def with_lora_request(params, lora_request: LoRARequest | None):
    """params, or a copy carrying `lora_request` (the caller's object is left unchanged)."""
    if lora_request is None:
        return params
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a jaxllm.lora.request.LoRARequest or None, "
                         f"got {type(lora_request).__name__}")
    extra = getattr(params, "extra_args", None)
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra_args must be a dict, got {type(extra).__name__}")
    extra = dict(extra or {})
    extra[LORA_REQUEST_KEY] = lora_request
    copy = params.clone()
    copy.extra_args = extra
    return copy


def cache_extra_keys(params) -> tuple:
    """What a request's KV depends on besides its tokens: its adapter (by id and name)."""
    lora = lora_request_of(params)
    return () if lora is None else (("lora", lora.lora_int_id, lora.lora_name),)
