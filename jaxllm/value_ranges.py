"""The widths a request's numbers are stored in, and the one range check that names them.

Owns the bounds the engine's arrays impose (token counts and top_k in int32, seeds in 64 bits,
the float knobs in float32; see runner/sampling_metadata.py) and `Range`, whose error (a
ValueError, `ParameterError`) names the parameter and its allowed values. A number past its
width used to overflow inside a step and fail every request in it, so admission refuses it
instead. Imports nothing from jaxllm and never touches a device.
"""

from __future__ import annotations

import dataclasses

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # np.finfo(np.float32).max
# The smallest positive float32 (a subnormal): anything smaller is 0.0 once stored.
FLOAT32_MIN_POSITIVE = 2.0**-149


class ParameterError(ValueError):
    """A ValueError about one named parameter; the server states it as the error's `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Range:
    """[low, high], or (low, high] with low_open. Comparisons only, never a conversion: NaN
    fails every comparison, and an int of any size compares exactly (math.isfinite(10**400)
    would raise OverflowError instead)."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value) -> bool:
        above = self.low < value if self.low_open else self.low <= value
        return above and value <= self.high

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low!r}, {self.high!r}]"

    def check(self, name: str, value) -> None:
        if value not in self:
            raise ParameterError(f"{name} must be in {self}, got {_shown(value)}.", name)


def _shown(value) -> str:
    # Python refuses to print an int of more than 4300 digits (and a 4000-digit echo helps
    # nobody): a huge int is described by its size instead.
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an int of {value.bit_length()} bits"
    return repr(value)
