"""Steering: a request's vector added to the residual stream after chosen layers.

Owns the device half of `Steer` (jaxllm/research/requests.py): per configured layer L one
per-slot table `steer.L` [R + 1, D] float32 of alpha * vector (zeros for a request that
does not steer L, and in the fill row R that padding rows read). At resid_post of L each
row adds its slot's vector in the compute dtype; a row that does not steer adds 0.0, which
leaves every value as it was, so plain requests in a mixed batch keep their exact tokens.
A table row is written (and sent) only when a request joins its slot. Never decides which
requests may share KV blocks (their cache key, jaxllm/research/requests.py, does).
"""

from __future__ import annotations

import numpy as np

from jaxllm.research.requests import steers_of
from jaxllm.runner.device_rows import DeviceRows, row_buckets
from jaxllm.runner.step_features import StepFeature


class Steering(StepFeature):
    name = "steer"

    def __init__(self, layers: tuple[int, ...], num_slots: int, hidden_size: int):
        self.layers = tuple(layers)
        self.tables = {layer: DeviceRows(num_slots, (hidden_size,), np.float32, 0.0,
                                         row_buckets=row_buckets(num_slots))
                       for layer in self.layers}

    def slot_rows(self) -> dict[str, DeviceRows]:
        return {f"steer.{layer}": table for layer, table in self.tables.items()}

    def add_request(self, slot: int, new) -> None:
        deltas = {s.layer: s.delta for s in steers_of(new.sampling_params)}
        for layer, table in self.tables.items():
            table.set_row(slot, deltas.get(layer, 0.0))

    def transform(self, site, layer, x_TD, hooks):
        if site != "resid_post" or layer not in self.tables:
            return x_TD
        delta_TD = hooks.rows[f"steer.{layer}"][hooks.slot_T]
        return x_TD + delta_TD.astype(x_TD.dtype)
