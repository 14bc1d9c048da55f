"""The seam every request-level capability that changes the jitted step grows from.

Owns the `StepFeature` interface and `StepHooks`, the trace-time object that carries the
features through one traced step. A feature is one object with three parts (STYLE.md,
"Seams"), each at a fixed place of the runner:

    host      slot_rows()            per-slot device tables (DeviceRows) the persistent batch
                                     owns: written by add_request when a request joins its
                                     slot, sent as diffs, read in the step by slot
              add_request(slot, p)   write this request's rows (the checked SamplingParams)
              update_states(so, slot_of)
                                     each step, after joins: write rows from the step's
                                     SchedulerOutput (e.g. this step's grammar bitmasks)
              prepare(step)          at packing: what the host must remember of this step
                                     (None: nothing to fetch)
    device    transform(site, layer, x_TD, hooks)
                                     at a named point of the forward (the residual stream's
                                     sites, jaxllm/research/requests.py; "logits" [S, V]
                                     before sampling, rows by hooks.slot_S); returns x_TD
              verify_constrained(hooks, K), mask_verify_rows(hooks, K, x_RV)
                                     speculative verification's logits [S * K, V]: whether
                                     any is constrained, and as constrained (grammars)
              after_sampling(step, hooks)
                                     at the "sampled" point, after the sampler: the step's
                                     hidden states, logits function, metadata and sample
                                     (runner/step.py SampledStep); records into hooks.recorded
              project(name, layer, x_TK, y_TN, hooks)
                                     at a dense layer (models/hooks.py StepHooks.project):
                                     its input and output; returns y_TN (e.g. LoRA)
              step_output(hooks)     an extra output of the step (None: none)
    host      collect(record, value) req_id -> what the request gets from this step (value:
                                     the step_output, still on the device: a feature copies
                                     only what its record asks for)
              sampled_tokens(record, value, tokens_SP, num_S)
                                     the tokens each sequence emits this step ([S, P] and
                                     their counts; by default the sampler's one per row):
                                     a feature may replace them (speculative verification)
              sampled_logprobs(record, value, logprobs, sampled)
                                     the same for the per-row LogprobsLists (one row per
                                     emitted token)

    static    the constructor's arguments: fixed per engine, so the buckets do not multiply

The model calls `hooks.at(site, layer, x_TD)` at each named point; with no feature that is
the identity and the program is unchanged. Features run in list order at a point (steering
before capture: a capture sees the steered stream). Never branches on a feature's name: the
runner, the step and the model only loop over features. (StepHooks lives with the models,
jaxllm/models/hooks.py: the model calls it and must not import the runner.)
"""

from __future__ import annotations

from typing import Any

import jax

from jaxllm.models.hooks import StepHooks
from jaxllm.runner.device_rows import DeviceRows


class StepFeature:
    """Base: a feature that adds nothing anywhere. Subclasses override what they use."""

    name = "feature"
    # Static: after_sampling reads the logits of packed rows other than the sampled ones
    # (SampledStep.logits_TV; the step then computes them with the sampled rows' where that
    # costs no more rows: runner/step.py step_logits).
    reads_row_logits = False

    def slot_rows(self) -> dict[str, DeviceRows]:
        return {}

    def add_request(self, slot: int, params) -> None:
        pass

    def update_states(self, so, slot_of: dict[str, int]) -> None:
        pass

    def prepare(self, step) -> Any:
        return None

    def verify_constrained(self, hooks: StepHooks, K: int) -> jax.Array | None:
        """Speculative verification: does this feature constrain any of the S x K verify
        rows this step (a traced bool), or None if it never does."""
        return None

    def mask_verify_rows(self, hooks: StepHooks, K: int, x_RV: jax.Array) -> jax.Array:
        """The verify rows' logits [S * K, V] as this feature constrains them."""
        return x_RV

    def transform(self, site: str, layer: int | None, x_TD: jax.Array,
                  hooks: StepHooks) -> jax.Array:
        return x_TD

    def after_sampling(self, step, hooks: StepHooks) -> None:
        pass
    def project(self, name: str, layer: int | None, x_TK: jax.Array, y_TN: jax.Array,
                hooks: StepHooks) -> jax.Array:
        return y_TN

    def step_output(self, hooks: StepHooks) -> Any:
        return None

    def sampled_tokens(self, record: Any, value: Any, tokens_SP, num_S):
        return tokens_SP, num_S

    def sampled_logprobs(self, record: Any, value: Any, logprobs: list, sampled: list) -> list:
        return logprobs

    def collect(self, record: Any, value: Any) -> dict[str, Any]:
        return {}
