"""How many draft tokens a step should verify: a step-time model measured while serving
(vLLM's disable_by_batch_size, with the threshold derived instead of configured, and per
token bucket instead of all or nothing).

Owns the measured wall time of the engine's steps by token bucket (the median of each
bucket's recent steps; the buckets are the runner's: powers of two and 1 + k) and the
per-step draft budget. A step with B decode rows runs in bucket(B) with no drafts. Drafts
move it to a bucket b >= bucket(B); D = min(b - B, available) drafts there emit about
B + a * D tokens in t(b), where a = accepted / drafted so far and D is the expected
number of drafts a budget of b - B takes (each row's proposal offers a run of m drafts
with probability p, both measured so far; a budget that cuts a run short loses its tail):

    budget = b* - B   for the b* that maximises (B + a * E[min(b - B, offered)]) / t(b)

So the padding of bucket(B) is always filled with drafts (same bucket, same time), and a
larger bucket is taken only while its extra tokens pay for themselves: memory-bound steps
(t flat in T) speculate fully, compute-bound ones (t ~ T) stop at their own bucket.
t of a bucket not measured yet comes from a least-squares line through the measured ones,
t = c + s * T; with fewer than two buckets measured the budget is unlimited (and so the
step measures). While the model stays in bucket(B) it still tries the next bucket one step
in PROBE_EVERY, so the times it decides by stay measured. Never touches a device or a
request.
"""

from __future__ import annotations

import numpy as np

from jaxllm.runner.buckets import pad_to_bucket, power_of_two_buckets

WINDOW = 8  # a bucket's time is the median of its last WINDOW steps (a compile is an outlier)
PROBE_EVERY = 16  # while in bucket(B), every PROBE_EVERY-th step tries the next bucket
UNLIMITED = 1 << 30  # a draft budget that no step reaches


def token_buckets(max_tokens: int, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The runner's token buckets (runner/buckets.py BucketConfig.create: powers of two from
    2, ending at max_tokens, and the `extra` ones in that range)."""
    powers = power_of_two_buckets(min(2, max_tokens), max_tokens)
    return tuple(sorted(set(powers).union(e for e in extra if powers[0] <= e <= max_tokens)))


def token_bucket(num_tokens: int, max_tokens: int, extra: tuple[int, ...] = ()) -> int:
    """The bucket a step of num_tokens runs in (capped at max_tokens)."""
    return pad_to_bucket(min(max(num_tokens, 2), max_tokens), token_buckets(max_tokens, extra),
                         "num_tokens")


class StepCostModel:
    def __init__(self, max_num_batched_tokens: int, extra_buckets: tuple[int, ...] = ()):
        self.max_tokens = max_num_batched_tokens
        self.buckets = token_buckets(max_num_batched_tokens, tuple(extra_buckets))
        self._recent: dict[int, list[float]] = {}  # bucket -> its last WINDOW step times
        self.seconds: dict[int, float] = {}  # bucket -> their median
        self._steps_in_own_bucket = 0
        self._proposal: list[float] = []  # a proposer's recent seconds per proposing row

    def bucket(self, num_tokens: int) -> int:
        return pad_to_bucket(min(max(num_tokens, 2), self.max_tokens), self.buckets,
                             "num_tokens")

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0:
            return
        recent = self._recent.setdefault(self.bucket(num_tokens), [])
        recent.append(seconds)
        del recent[:-WINDOW]
        self.seconds[self.bucket(num_tokens)] = float(np.median(recent))

    def step_time(self, num_tokens: int) -> float | None:
        b = self.bucket(num_tokens)
        if b in self.seconds:
            return self.seconds[b]
        if len(self.seconds) < 2:
            return None
        T = np.array(sorted(self.seconds), float)
        t = np.array([self.seconds[int(x)] for x in T])
        slope, intercept = np.polyfit(T, t, 1)
        return max(float(intercept + slope * b), 1e-9)

    def observe_proposal(self, num_rows: int, seconds: float) -> None:
        """A proposer's time ahead of a step (a draft model's run over num_rows rows): the
        cost per proposing row, added to a candidate's step time by the rows it drafts."""
        if num_rows > 0:
            self._proposal.append(seconds / num_rows)
            del self._proposal[:-WINDOW]

    def draft_budget(self, num_rows: int, hit_rate: float, drafts_per_hit: float,
                     acceptance_rate: float) -> tuple[int, bool]:
        """-> (draft tokens to schedule this step, whether it stays in bucket(num_rows)).
        hit_rate: the share of rows whose proposal offered drafts so far; drafts_per_hit:
        how many such a proposal offered; acceptance_rate: accepted / drafted so far."""
        if num_rows <= 0:
            return 0, True
        own = self.bucket(num_rows)
        per_row = float(np.median(self._proposal)) if self._proposal else 0.0
        # (bucket, room for drafts): none at all first, then the own bucket's padding.
        candidates = [(own, 0)] + [(b, b - num_rows) for b in self.buckets if b >= own]
        best, best_room, best_rate, next_bucket, prev_room = own, 0, None, None, None
        for b, room in candidates:
            if prev_room is not None and prev_room >= num_rows * drafts_per_hit:
                break  # a smaller bucket already holds every draft a step could offer
            if room <= 0 and prev_room is not None:
                continue
            prev_room = room
            t = self.step_time(b)
            if t is None:
                return UNLIMITED, False  # nothing to decide by yet: speculate and measure
            if room > 0:
                t += per_row * min(num_rows, -(-room // max(drafts_per_hit, 1)))
            drafts = expected_drafts(room, num_rows, hit_rate, drafts_per_hit)
            rate = (num_rows + acceptance_rate * drafts) / t
            if b > own and next_bucket is None:
                next_bucket = b
            if best_rate is None or rate > best_rate:
                best, best_room, best_rate = b, room, rate
        if best == own:
            self._steps_in_own_bucket += 1
            if next_bucket is not None and self._steps_in_own_bucket % PROBE_EVERY == 0:
                return next_bucket - num_rows, False  # probe
            return best_room, True
        self._steps_in_own_bucket = 0
        return best_room, False


def expected_drafts(budget: int, num_rows: int, hit_rate: float, drafts_per_hit: float) -> float:
    """E[min(budget, drafts offered)] when each of num_rows rows offers drafts_per_hit drafts
    with probability hit_rate (else none): a budget that cuts into a hit's run loses the
    rest of it, so the mean alone would flatter a budget below one whole run."""
    if budget <= 0 or hit_rate <= 0 or drafts_per_hit <= 0:
        return 0.0
    hits_H = np.arange(num_rows + 1)
    offered_H = np.minimum(budget, hits_H * drafts_per_hit)
    if hit_rate >= 1:
        return float(offered_H[-1])
    # Binomial(num_rows, hit_rate) in logs (a pmf term can underflow at hundreds of rows).
    log_choose_H = np.concatenate(
        [[0.0], np.cumsum(np.log(num_rows - hits_H[:-1]) - np.log(hits_H[:-1] + 1))])
    log_pmf_H = (log_choose_H + hits_H * np.log(hit_rate)
                 + (num_rows - hits_H) * np.log1p(-hit_rate))
    return float(np.exp(log_pmf_H) @ offered_H)
