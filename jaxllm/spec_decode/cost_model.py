"""When speculation pays: a step-time model measured while serving (vLLM's
disable_by_batch_size, with the threshold derived instead of configured).

Owns the measured wall time of the engine's steps by token bucket (the median of each
bucket's recent steps: the runner's token buckets, powers of two and 1 + k) and the
per-step decision.
With B running rows, speculation emits on average L = 1 + accepted / drafts tokens per row
(the engine's own acceptance so far) at the cost of a step over about B * (1 + m) tokens
(m = drafts per verified row so far), against B tokens in a plain step:

    speculate  <=>  B * L / t(bucket(B * (1 + m)))  >=  B / t(bucket(B))

t of a bucket not measured yet comes from a least-squares line through the measured ones,
t = a + b * T (so a memory-bound regime, b ~ 0, speculates, and a compute-bound one, where
t grows with T, stops once L no longer covers the extra tokens); with fewer than two
buckets measured it speculates (and so measures). While off it still speculates one step
in PROBE_EVERY, so the times it decides by stay measured. Never touches a device or a
request.
"""

from __future__ import annotations

import numpy as np

WINDOW = 8  # a bucket's time is the median of its last WINDOW steps (a compile is an outlier)
PROBE_EVERY = 16  # while off, every PROBE_EVERY-th step speculates anyway, to keep measuring


def token_bucket(num_tokens: int, max_tokens: int, extra: tuple[int, ...] = ()) -> int:
    """The runner's bucket of a step of num_tokens (powers of two from 2, capped, and the
    `extra` ones: runner/buckets.py BucketConfig.create's extra_tokens)."""
    bucket = 2
    while bucket < num_tokens:
        bucket *= 2
    return min([min(bucket, max_tokens)] +
               [e for e in extra if max(num_tokens, 2) <= e <= max_tokens])


class StepCostModel:
    def __init__(self, max_num_batched_tokens: int, extra_buckets: tuple[int, ...] = ()):
        self.max_tokens = max_num_batched_tokens
        self.extra_buckets = tuple(extra_buckets)
        self._recent: dict[int, list[float]] = {}  # bucket -> its last WINDOW step times
        self.seconds: dict[int, float] = {}  # bucket -> their median
        self._steps_off = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0:
            return
        b = token_bucket(num_tokens, self.max_tokens, self.extra_buckets)
        recent = self._recent.setdefault(b, [])
        recent.append(seconds)
        del recent[:-WINDOW]
        self.seconds[b] = float(np.median(recent))

    def step_time(self, num_tokens: int) -> float | None:
        b = token_bucket(num_tokens, self.max_tokens, self.extra_buckets)
        if b in self.seconds:
            return self.seconds[b]
        if len(self.seconds) < 2:
            return None
        T = np.array(sorted(self.seconds), float)
        t = np.array([self.seconds[int(x)] for x in T])
        slope, intercept = np.polyfit(T, t, 1)
        return max(float(intercept + slope * b), 1e-9)

    def should_speculate(self, num_rows: int, mean_drafts: float,
                         mean_acceptance_length: float) -> bool:
        if num_rows <= 0:
            return True
        plain = self.step_time(num_rows)
        spec = self.step_time(min(self.max_tokens, int(round(num_rows * (1 + mean_drafts)))))
        if plain is None or spec is None:
            return True
        if mean_acceptance_length / spec >= 1.0 / plain:
            self._steps_off = 0
            return True
        # Off; but a model that never speculates again never measures again (a step time
        # inflated by load or a compile would keep it off for good): probe now and then.
        self._steps_off += 1
        return self._steps_off % PROBE_EVERY == 0
