"""Logit bias: each request's {token id: bias}, added to its logits before sampling.

Owns the device half of `SamplingParams.logit_bias` (vLLM's field; the server's `logit_bias`).
One per-slot table `logit_bias` [R + 1, 2, M] float32, M = MAX_LOGIT_BIAS_TOKENS: row [0]
holds V - token id (exact in float32 below 2^24), so that the fill value 0 (unused columns,
the fill row) reads as id V, past the vocabulary; row [1] the biases. One table, not an int
and a float one, so that it adds one set of upload programs to the warm-up. A row is written
only when a request joins its slot (a plain request after a biased one resets it). At the
"logits" point each sequence adds its slot's biases with a scatter whose out-of-vocabulary
ids are dropped; a `lax.cond` skips it when no row of the step is biased. Never validates a
bias (SamplingParams and the processor do).

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
        if vocab_size >= 2**24:
            raise ValueError(f"LogitBias keeps token ids in float32, exact below 2^24; the "
                             f"vocabulary has {vocab_size}")
        self.vocab_size, self.width = vocab_size, width
        self.table = DeviceRows(num_slots, (2, width), np.float32, 0.0,
                                row_buckets=row_buckets(num_slots))

    def slot_rows(self) -> dict[str, DeviceRows]:
        return {"logit_bias": self.table}

    def add_request(self, slot: int, new) -> None:
        bias = new.sampling_params.logit_bias or {}
        row = np.zeros((2, self.width), np.float32)
        row[0, :len(bias)] = self.vocab_size - np.array(list(bias), np.int64)
        row[1, :len(bias)] = list(bias.values())
        self.table.set_row(slot, row)

    def transform(self, site, layer, logits_SV, hooks):
        if site != "logits":
            return logits_SV
        row_S2M = hooks.rows["logit_bias"][hooks.slot_S]
        ids_SM = self.vocab_size - row_S2M[:, 0].astype(jnp.int32)
        values_SM = row_S2M[:, 1]

        def add(x_SV):
            rows_S1 = jnp.arange(x_SV.shape[0])[:, None]
            return x_SV.at[rows_S1, ids_SM].add(values_SM.astype(x_SV.dtype), mode="drop")

        return jax.lax.cond(jnp.any(ids_SM < self.vocab_size), add, lambda x: x, logits_SV)
