"""Typed readers of config.json keys, shared by models/config.py and config_families.py.

Owns: reading one key as an int, a float or an object, and the RoPE keys whose place moved
between transformers versions, each error naming the key and what it must be. Never imports
jax and never reads files.
"""

from __future__ import annotations

from typing import Any, Mapping


def optional_int(hf: Mapping[str, Any], key: str) -> int | None:
    """hf[key] as an int, None when absent or null. 12.0 is accepted; 12.5, "12", true are not."""
    value = hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"config key {key!r} must be an integer, got {value!r}")
    return int(value)


def required_int(hf: Mapping[str, Any], key: str) -> int:
    value = optional_int(hf, key)
    if value is None:
        state = "null" if key in hf else "missing"
        raise ValueError(f"config key {key!r} (an integer) is required but is {state}")
    return value


def read_float(hf: Mapping[str, Any], key: str, default: float, where: str = "config") -> float:
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} key {key!r} must be a number, got {value!r}")
    return float(value)


def read_rope_params(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The RoPE object (`rope_parameters`, or the older `rope_scaling`), {} if absent."""
    # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`.
    for key in ("rope_parameters", "rope_scaling"):
        value = hf.get(key)
        if value:
            if not isinstance(value, Mapping):
                raise ValueError(f"config key {key!r} must be an object, got {value!r}")
            return value
    return {}


def read_rope_theta(hf: Mapping[str, Any]) -> float:
    if hf.get("rope_theta") is not None:
        return read_float(hf, "rope_theta", 10000.0)
    return read_float(read_rope_params(hf), "rope_theta", 10000.0, where="rope_parameters")
