"""Captured activations on the host: what one step returns for a request, and what a
completion accumulates.

Owns `ActivationChunk` (one step's rows of one request: positions [N] and name -> [N, D])
and `Activations` (a completion's captures, by position). A position computed twice (a
request preempted and recomputed) keeps its last value. Never imports jax.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ActivationChunk:
    positions: np.ndarray  # [N] int32, token positions, ascending
    values: dict[str, np.ndarray]  # name -> [N, ...] float32 ([N, D]; [N, heads, H] per head)


class Activations:
    """A completion's captured activations. `positions` [P] int32 ascending (the token
    positions computed while it captured, filtered by its Capture), and `self[name]` the
    float32 values at them, [P, D] on the residual stream and [P, heads, head_dim] for
    q, k, v and z: self["layers.3.resid_post"][i] is the residual stream after layer 3
    at token position positions[i]."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self._rows: dict[int, dict[str, np.ndarray]] = {}

    def add(self, chunk: ActivationChunk) -> None:
        for i, pos in enumerate(chunk.positions.tolist()):
            self._rows[pos] = {name: chunk.values[name][i] for name in self.names}

    @property
    def positions(self) -> np.ndarray:
        return np.array(sorted(self._rows), np.int32)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise KeyError(f"{name!r} was not captured; captured: {list(self.names)}")
        rows = [self._rows[p][name] for p in sorted(self._rows)]
        return np.stack(rows) if rows else np.zeros((0, 0), np.float32)

    def keys(self) -> tuple[str, ...]:
        return self.names

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"Activations(names={list(self.names)}, positions={len(self._rows)})"
