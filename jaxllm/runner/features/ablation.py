"""Head ablation: chosen attention heads' outputs replaced, per request.

Owns the device half of `Ablate` (jaxllm/research/requests.py): per configured layer L two
per-slot tables, `ablate.L.keep` [R + 1, N] float32 (1 keeps a head; the fill value, so
padding and plain rows keep every head) and `ablate.L.fill` [R + 1, N, H] float32 (what a
replaced head becomes: zeros, or the request's means). At site z of L (the attention output
per head, before o_proj) each row computes z * keep + fill in the compute dtype; a plain row
multiplies by 1 and adds 0, which leaves every value as it was. Rows are written only when a
request joins its slot. Never decides which requests may share KV blocks (their cache key
does).
"""

from __future__ import annotations

import numpy as np

from jaxllm.research.requests import ablations_of
from jaxllm.runner.device_rows import DeviceRows, row_buckets
from jaxllm.runner.step_features import StepFeature


class HeadAblationFeature(StepFeature):
    name = "ablate"

    def __init__(self, layers: tuple[int, ...], num_slots: int, num_heads: int, head_dim: int):
        self.layers = tuple(layers)
        buckets = row_buckets(num_slots)
        self.keep = {layer: DeviceRows(num_slots, (num_heads,), np.float32, 1.0,
                                       row_buckets=buckets) for layer in self.layers}
        self.fill = {layer: DeviceRows(num_slots, (num_heads, head_dim), np.float32, 0.0,
                                       row_buckets=buckets) for layer in self.layers}

    def slot_rows(self) -> dict[str, DeviceRows]:
        rows = {f"ablate.{layer}.keep": table for layer, table in self.keep.items()}
        rows.update({f"ablate.{layer}.fill": table for layer, table in self.fill.items()})
        return rows

    def add_request(self, slot: int, new) -> None:
        asked = {a.layer: a for a in ablations_of(new.sampling_params)}
        for layer in self.layers:
            a = asked.get(layer)
            self.keep[layer].set_row(slot, 1.0 if a is None else a.keep)
            self.fill[layer].set_row(slot, 0.0 if a is None else a.fill)

    def transform(self, site, layer, z_TNH, hooks):
        if site != "z" or layer not in self.keep:
            return z_TNH
        keep_TN = hooks.rows[f"ablate.{layer}.keep"][hooks.slot_T].astype(z_TNH.dtype)
        fill_TNH = hooks.rows[f"ablate.{layer}.fill"][hooks.slot_T].astype(z_TNH.dtype)
        return z_TNH * keep_TN[:, :, None] + fill_TNH
