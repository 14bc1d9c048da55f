"""Activation capture: the step returns the configured sites of every row.

Owns the device half of `Capture` (jaxllm/research/requests.py). At each configured
(site, layer) the forward's value is recorded as traced ([T, D] on the residual stream,
[T, heads, head_dim] for q, k, v and z); the step returns them as one dict by name, in the
compute dtype, for every row whatever it asked: no per-row table and no branch, so a step
whose requests capture nothing pays one copy of those values and the host never fetches
them. At packing (`prepare`) the host notes which rows of which capturing request it
wants; at fetch it copies only the sites those requests asked for and cuts them per request
(`collect`). Never changes a value.

    step rows      0..4 (A, prompt 0..4)   5 (B, decode at 7)   6..15 padding
    A captures "prompt": rows 0..4 -> positions 0..4;  B captures nothing: row 5 unread
"""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.research.activations import ActivationChunk
from jaxllm.research.requests import ResearchConfig, capture_of, point_name
from jaxllm.runner.step_features import StepFeature


class ActivationCapture(StepFeature):
    name = "capture"

    def __init__(self, research: ResearchConfig, num_slots: int):
        self.points = research.capture_points
        self.index = {point: k for k, point in enumerate(self.points)}
        self.names = [point_name(site, layer) for site, layer in self.points]
        self.selection = [None] * num_slots
        self.num_prompt_tokens = np.zeros(num_slots, np.int64)

    def add_request(self, slot: int, new) -> None:
        self.selection[slot] = capture_of(new.sampling_params)
        self.num_prompt_tokens[slot] = len(new.prompt_token_ids)

    def prepare(self, step):
        """[(req_id, rows [N], positions [N], selection)] of this step's capturing rows."""
        record = []
        qsl = step.query_start_loc
        for i, req_id in enumerate(step.req_ids):
            slot = int(step.slot_S[i])
            selection = self.selection[slot]
            if selection is None:
                continue
            rows = np.arange(qsl[i], qsl[i + 1])
            positions = step.positions[rows]
            keep = selection.keep(positions, int(self.num_prompt_tokens[slot]))
            if keep.any():
                record.append((req_id, rows[keep], positions[keep], selection))
        return record or None

    def transform(self, site, layer, x_TD, hooks):
        if (site, layer) in self.index:
            hooks.recorded[(self.name, site, layer)] = x_TD
        return x_TD

    def step_output(self, hooks):
        return {name: hooks.recorded[(self.name, *point)]
                for name, point in zip(self.names, self.points)}  # name -> [T, ...]

    def collect(self, record, value) -> dict[str, ActivationChunk]:
        """Copies the sites some request of the step asked for (each whole, [T, ...]: a
        device-side cut would compile per row count), then cuts them per request."""
        needed = sorted({name for *_, selection in record for name in selection.names})
        host = jax.device_get({name: value[name] for name in needed})
        out = {}
        for req_id, rows, positions, selection in record:
            out[req_id] = ActivationChunk(
                positions.astype(np.int32),
                {name: np.asarray(host[name])[rows].astype(np.float32)
                 for name in selection.names})
        return out
