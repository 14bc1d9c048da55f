"""Logit bias: each request's {token id: bias}, added to its logits before sampling.

Owns the device half of `SamplingParams.logit_bias` (vLLM's field; the server's `logit_bias`).
Two per-slot tables of M = MAX_LOGIT_BIAS_TOKENS columns: `logit_bias.ids` [R + 1, M] int32
(V, past the vocabulary, in unused columns and the fill row) and `logit_bias.values`
[R + 1, M] float32. A row is written only when a request joins its slot (a plain request
after a biased one resets it). At the "logits" point each sequence adds its slot's biases
with a scatter whose out-of-vocabulary ids are dropped; a `lax.cond` skips it when no row
of the step is biased. Never validates a bias (SamplingParams and the processor do).

Unlike vLLM, where the bias is applied after the raw logprobs are taken, returned raw
logprobs here include the bias: the "logits" point is before the sampler's raw copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.runner.device_rows import DeviceRows, row_buckets
from jaxllm.runner.step_features import StepFeature
from jaxllm.sampling_params import MAX_LOGIT_BIAS_TOKENS


class LogitBias(StepFeature):
    name = "logit_bias"

    def __init__(self, num_slots: int, vocab_size: int, width: int = MAX_LOGIT_BIAS_TOKENS):
        self.vocab_size, self.width = vocab_size, width
        self.ids = DeviceRows(num_slots, (width,), np.int32, vocab_size,
                              row_buckets=row_buckets(num_slots))
        self.values = DeviceRows(num_slots, (width,), np.float32, 0.0,
                                 row_buckets=row_buckets(num_slots))

    def slot_rows(self) -> dict[str, DeviceRows]:
        return {"logit_bias.ids": self.ids, "logit_bias.values": self.values}

    def add_request(self, slot: int, new) -> None:
        bias = new.sampling_params.logit_bias or {}
        ids = np.full(self.width, self.vocab_size, np.int32)
        values = np.zeros(self.width, np.float32)
        ids[:len(bias)] = list(bias)
        values[:len(bias)] = list(bias.values())
        self.ids.set_row(slot, ids)
        self.values.set_row(slot, values)

    def transform(self, site, layer, logits_SV, hooks):
        if site != "logits":
            return logits_SV
        ids_SM = hooks.rows["logit_bias.ids"][hooks.slot_S]
        values_SM = hooks.rows["logit_bias.values"][hooks.slot_S]

        def add(x_SV):
            rows_S1 = jnp.arange(x_SV.shape[0])[:, None]
            return x_SV.at[rows_S1, ids_SM].add(values_SM.astype(x_SV.dtype), mode="drop")

        return jax.lax.cond(jnp.any(ids_SM < self.vocab_size), add, lambda x: x, logits_SV)
