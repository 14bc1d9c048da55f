"""The named points of a forward pass, where a step's features read or change the residual
stream (jaxllm/runner/step_features.py owns the features themselves).

Owns `StepHooks`, the trace-time object a model calls at each point: `hooks.at(site, layer,
x_TD) -> x_TD` (sites: jaxllm/research/requests.py; and "logits", the step's [S, V]
logits of the sequences that sample, before the sampler). A dense projection is a point too:
`hooks.project(module, x_TK, y_TN) -> y_TN` (called by models/parallel.py ParallelOps for
every linear layer, so the models need no change) gives the features the layer's input and
output under its name and layer ("q_proj", 3: the last part of its module path and the
first index in it, `bind(model)`). It holds the features of one traced
step, the per-slot tables they read, each row's slot, and what they record for the step's
outputs. `NO_HOOKS` (no features) is the identity: a model traced with it compiles to the
program it would be without hooks. Never knows what a feature does.
"""

from __future__ import annotations

from typing import Any

import jax


class StepHooks:
    """One traced step's features (each with transform(site, layer, x_TD, hooks) and
    step_output(hooks)), its per-slot tables (`rows`, name -> [R + 1, ...]), each token
    row's slot (`slot_T`, R for padding, which reads the fill row R), each sequence's slot
    (`slot_S`, for the points with one row per sequence: "logits" [S, V]), and what
    features record while the forward is traced (`recorded`)."""

    def __init__(self, features: tuple = (), rows: dict[str, jax.Array] | None = None,
                 slot_T: jax.Array | None = None, slot_S: jax.Array | None = None):
        self.features = tuple(features)
        self.rows = rows or {}
        self.slot_T = slot_T
        self.slot_S = slot_S
        self.recorded: dict[Any, jax.Array] = {}
        self.projections: dict[int, tuple[str, int | None]] = {}  # id(module) -> name, layer

    def bind(self, model) -> "StepHooks":
        """Name the dense layers of this trace's `model` (its modules are new objects each
        trace); nothing without features."""
        if self.features:
            self.projections = projection_names(model)
        return self

    def project(self, module, x_TK: jax.Array, y_TN: jax.Array) -> jax.Array:
        """A dense layer's output y_TN, as the features change it from its input x_TK."""
        named = self.projections.get(id(module))
        if named is None:
            return y_TN
        for feature in self.features:
            y_TN = feature.project(named[0], named[1], x_TK, y_TN, self)
        return y_TN

    def at(self, site: str, layer: int | None, x_TD: jax.Array) -> jax.Array:
        for feature in self.features:
            x_TD = feature.transform(site, layer, x_TD, self)
        return x_TD

    def sampled(self, step: Any) -> None:
        """The "sampled" point, after the sampler: each feature's after_sampling(step, hooks)
        sees the step's hidden states and its sample (runner/step.py SampledStep) and may
        record an output (e.g. speculative verification)."""
        for feature in self.features:
            feature.after_sampling(step, self)

    def outputs(self) -> dict[str, Any]:
        """feature name -> its extra step output, for the features that have one."""
        out = {}
        for feature in self.features:
            value = feature.step_output(self)
            if value is not None:
                out[feature.name] = value
        return out


def projection_names(model) -> dict[int, tuple[str, int | None]]:
    """id(module) -> (name, layer) of each nnx.Linear of `model`: its path's last part and
    first integer ("model.layers.3.self_attn.q_proj" -> ("q_proj", 3))."""
    from flax import nnx

    names = {}
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear) and path:
            layer = next((p for p in path if isinstance(p, int)), None)
            names[id(module)] = (str(path[-1]), layer)
    return names


NO_HOOKS = StepHooks()
