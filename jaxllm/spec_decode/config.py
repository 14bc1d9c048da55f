"""SpeculativeConfig: vLLM's `speculative_config`, frozen and validated with ValueError.

Owns the fields, their defaults and their checks (vLLM's SpeculativeConfig rules for the
n-gram method: prompt_lookup_min/max default to each other, both 5 when neither is given,
min <= max; a draft `model` alone means method "draft_model"). Never builds a proposer or
touches a device. Methods "ngram" and "draft_model" are implemented; EAGLE heads and the
other methods are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model")
# vLLM methods this engine refuses for now, with the reason in the error.
_NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix",
            "ngram_gpu", "custom_class")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # jaxllm's own (vLLM has none of this name): each step's draft budget comes from the
    # measured step-time model, fewer or no drafts where their extra tokens would cost more
    # than acceptance gives back (spec_decode/cost_model.py; the role of vLLM's former
    # disable_by_batch_size). False: every eligible row takes up to k drafts.
    auto_disable: bool = True
    # The draft checkpoint of method "draft_model" (vLLM's `model`; given alone, it sets
    # that method): a path or name, as LLM's model, sharing the target's tokenizer.
    model: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict or None, got "
                             f"{type(d).__name__}")
        d = dict(d)
        if d.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling of the method
            d.pop("model")
            d.setdefault("method", "ngram")
        elif d.get("model") is not None:
            d.setdefault("method", "draft_model")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"speculative_config got unknown keys {unknown}; accepted: "
                             f"{sorted(fields)}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs num_speculative_tokens (an int >= 1)")
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method == "[ngram]":
            object.__setattr__(self, "method", "ngram")
        if self.method in _NOT_YET:
            raise ValueError(f"speculative_config method {self.method!r} is not supported yet; "
                             f"method must be one of {METHODS}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got "
                             f"{self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config model (a draft checkpoint) is needed by, and "
                             "only by, method 'draft_model'; got method "
                             f"{self.method!r} and model {self.model!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config model must be a str, got {self.model!r}")
        if not isinstance(self.auto_disable, bool):
            raise ValueError(f"auto_disable must be a bool, got {self.auto_disable!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)


def speculative_config_of(value) -> SpeculativeConfig | None:
    """EngineConfig's field: None, a SpeculativeConfig, a dict of its fields, or that dict
    as JSON (`jaxllm serve --speculative-config '{...}'`, as vLLM's flag)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}: "
                             f"{e}") from None
    return SpeculativeConfig.from_dict(value)
