"""Row means whose bits do not depend on how many rows the step has.

Owns `row_mean`, the norms' reduction over the last axis. XLA's CPU backend hands a reduce to
YNNPACK, whose order of additions depends on the row count: the mean of the same [576] row
differs in the last bit between a [2, 576] and an [8, 576] operand (below 8 rows and from 8
on). A norm must give a row the same bits whatever the other rows of the step, or greedy
speculative decoding (a verify step of 1 + k rows) diverges from plain decoding (1 row
padded to 2). So the sum here is elementwise adds in a fixed order, which XLA never
reassociates: the row is cut into lanes-wide slices summed left to right, then the lanes are
halved pairwise. In a fused step this costs what the reduce does (SmolLM2's 576 wide rows,
61 norms per step, 2 to 64 rows: within noise of jnp.mean). Must never call a reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 64


def _halve(v_TL: jax.Array) -> jax.Array:
    """[..., L] -> [..., 1]: adjacent halves added pairwise until one lane is left."""
    while v_TL.shape[-1] > 1:
        L = v_TL.shape[-1]
        h = L // 2
        s = v_TL[..., :h] + v_TL[..., h:2 * h]
        v_TL = jnp.concatenate([s, v_TL[..., 2 * h:]], axis=-1) if L % 2 else s
    return v_TL


def row_sum(x_TD: jax.Array) -> jax.Array:
    """Sum over the last axis, keepdims, in a fixed order of elementwise adds."""
    D = x_TD.shape[-1]
    lanes = min(LANES, D)
    pad = -D % lanes
    if pad:
        x_TD = jnp.pad(x_TD, [(0, 0)] * (x_TD.ndim - 1) + [(0, pad)])
    acc = x_TD[..., :lanes]
    for j in range(1, x_TD.shape[-1] // lanes):
        acc = acc + x_TD[..., j * lanes:(j + 1) * lanes]
    return _halve(acc)


def row_mean(x_TD: jax.Array) -> jax.Array:
    """Mean over the last axis, keepdims (jnp.mean(x, -1, keepdims=True), row-invariant)."""
    return row_sum(x_TD) * (1.0 / x_TD.shape[-1])
