"""PoolingParams: what a pooling request may ask of the pooled row (vLLM's names).

Owns the fields and their checks. `use_activation` is vLLM's current name; `activation`
(and `softmax`, its older spelling) set it too. `normalize` None: the model's default (on
for embedding models). `truncate_prompt_tokens`: keep the last k prompt tokens (-1: as many
as max_model_len); without it a prompt longer than max_model_len is a ValueError.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PoolingParams:
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an int >= 1 or None, got {self.dimensions!r}")
        for name in ("normalize", "use_activation", "activation", "softmax"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool or None, got {value!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an int >= 1, got {k!r}")

    def clone(self) -> "PoolingParams":
        return dataclasses.replace(self)

    def applies_activation(self, default: bool = True) -> bool:
        """The request's choice, else `default` (the engine's pooler_config)."""
        for value in (self.use_activation, self.activation, self.softmax):
            if value is not None:
                return value
        return default


__all__ = ["PoolingParams"]
