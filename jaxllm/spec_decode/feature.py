"""Speculative verification as one step feature (runner/step_features.py).

Owns the device half of speculative decoding. The scheduler gives a decode row 1 + m packed
positions: its last known token, then m <= K drafts (SchedulerOutput.
scheduled_spec_decode_tokens; the input batch feeds them as ordinary row tokens). The
sampler still samples at each sequence's last row, which for a drafted row is the position
after the last draft: the bonus token. At the "sampled" point this feature computes the
target's logits at the m positions that verify the drafts, processes them as the sampler
does (temperature, min-p, top-k, top-p) and runs `rejection_sample`:

    packed rows of one sequence:   t   d0  d1  d2        (m = 3, K = 4)
    row predicts:                  d0  d1  d2  bonus
    verify rows (last - m + j):    j=0 j=1 j=2           (j = 3: padding, not valid)

  host    one per-slot table `spec_num_drafts` [R + 1, 1] int32 (m of the slot's request this
          step; 0 when it joins, and the fill row for padding), sent as entries when it
          changes; `sampled_tokens` replaces the sampler's one token per row by the accepted
          run (the record is only kept for steps with drafts)
  device  a `lax.cond` on "any row has drafts": a step without drafts computes nothing more.
          Greedy verification needs only the argmax at the verify rows: where T <= S x K
          it is taken over the T packed rows' logits, which a bucket with T == S already
          has from the sampler's LM head (runner/step.py step_logits: one LM head per
          step); the [S * K, V] verify logits are built only where some row samples
  static  K = num_speculative_tokens

Rows that get drafts are only those the scheduler found eligible (spec_decode/scheduling.py:
no penalties, bad words, allowed ids or logit bias), so the sampler's other logits
processors never have to run on the verify positions; a grammar's masks at the verify rows
come from the features that constrain them (`mask_verify_rows`: runner/features/grammar.py),
applied before both the greedy argmax and the sampling rows' processing. Logprobs of the emitted tokens are
raw logprobs (rows asking for them get drafts only in the raw_logprobs mode): the verify
rows' for the drafts and the recovered token, the sampler's for the bonus. Never proposes, never
decides acceptance rules (rejection.py), never touches the token history.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.messages import LogprobsLists
from jaxllm.runner.device_rows import DeviceRows, entry_buckets
from jaxllm.runner.sampler import (_apply_min_p, apply_top_k_top_p, gather_logprobs,
                                   logprobs_lists, num_topk, zero_logprobs)
from jaxllm.runner.step_features import StepFeature
from jaxllm.sampling_params import SAMPLING_EPS
from jaxllm.kernels.cpu_argmax import argmax_first_here as argmax_first
from jaxllm.spec_decode.rejection import verify_drafts


class SpecDecodeFeature(StepFeature):
    name = "spec_decode"
    reads_row_logits = True  # the verify rows (runner/step.py step_logits)

    def __init__(self, num_slots: int, num_speculative_tokens: int, vocab_size: int,
                 max_logprobs: int = 20):
        """max_logprobs: the engine's (the top-k width of the verify rows' logprobs, which
        are raw logprobs: the scheduler gives drafts to rows asking for logprobs only in
        the engine's raw_logprobs mode)."""
        self.k = num_speculative_tokens
        self.topk = num_topk(max_logprobs, vocab_size)
        self.num_drafts = DeviceRows(num_slots, (1,), np.int32, 0,
                                     entry_buckets=entry_buckets(num_slots))
        self._drafts: dict[str, int] = {}  # this step's: req_id -> number of drafts

    def slot_rows(self) -> dict[str, DeviceRows]:
        return {"spec_num_drafts": self.num_drafts}

    def add_request(self, slot: int, new) -> None:
        self.num_drafts.set_row(slot, 0)

    def update_states(self, so, slot_of: dict[str, int]) -> None:
        drafts = so.scheduled_spec_decode_tokens
        for req_id in so.num_scheduled_tokens:
            self.num_drafts.set(slot_of[req_id], 0, len(drafts.get(req_id, ())))
        self._drafts = {r: len(d) for r, d in drafts.items()}

    def prepare(self, step):
        """-> the drafts of each packed sequence (by row), for steps that have any."""
        if not self._drafts:
            return None
        return [self._drafts.get(r, 0) for r in step.req_ids]

    def after_sampling(self, step, hooks) -> None:
        K = self.k
        bm, smd = step.bm, step.smd
        m_S = hooks.rows["spec_num_drafts"][hooks.slot_S, 0]
        S = m_S.shape[0]
        T = step.input_ids_T.shape[0]
        one_S = jnp.ones(S, jnp.int32)

        topk = self.topk

        def verify():
            rows_SK = jnp.clip(bm.logits_indices_S[:, None] - m_S[:, None]
                               + jnp.arange(K, dtype=jnp.int32)[None, :], 0, T - 1)
            rows_R = rows_SK.reshape(-1)
            draft_SK = step.input_ids_T[jnp.minimum(rows_SK + 1, T - 1)]
            # The LM head runs once over the fewer of the T packed rows and the S x K verify
            # rows (static per bucket: a small decode bucket has T < S x K), and not at all
            # where the step already ran it over every row (step.logits_TV).
            logits_TV = step.logits_TV
            if logits_TV is None and T < S * K:
                logits_TV = step.logits_fn(step.hidden_TD)
            if logits_TV is not None:
                # The argmax over the T rows, then gathered: fewer rows than S x K.
                argmax_SK = argmax_first(logits_TV)[rows_R].reshape(S, K)
                raw_RV = lambda: logits_TV[rows_R]  # noqa: E731  [S * K, V]
            else:
                logits_RV = step.logits_fn(step.hidden_TD[rows_R])  # [S * K, V]
                argmax_SK = argmax_first(logits_RV).reshape(S, K)
                raw_RV = lambda: logits_RV  # noqa: E731
            # Features that constrain the verify rows (grammars): both checks run on the
            # constrained logits, which are built only in a step where some row is.
            constrained = [c for f in hooks.features
                           if (c := f.verify_constrained(hooks, K)) is not None]
            verify_RV = raw_RV
            if constrained:
                def masked_RV():
                    x_RV = raw_RV()
                    for f in hooks.features:
                        x_RV = f.mask_verify_rows(hooks, K, x_RV)
                    return x_RV

                verify_RV = masked_RV
                argmax_SK = jax.lax.cond(
                    jnp.any(jnp.stack(constrained)),
                    lambda: argmax_first(verify_RV()).reshape(S, K), lambda: argmax_SK)
            is_greedy_S = smd.temperature < SAMPLING_EPS
            rep = lambda x_S: jnp.repeat(x_S, K, axis=0)  # noqa: E731

            def processed_SKV():
                """Traced only where some row samples (rejection.verify_drafts): greedy rows
                verify against the raw argmax, so their rows here are never read."""
                x_RV = verify_RV() / rep(jnp.where(is_greedy_S, 1.0, smd.temperature))[:, None]
                x_RV = _apply_min_p(x_RV, rep(smd.min_p))
                return apply_top_k_top_p(x_RV, rep(smd.top_k), rep(smd.top_p)).reshape(S, K, -1)

            tokens_SP, num_S = verify_drafts(argmax_SK, processed_SKV, draft_SK, m_S,
                                             step.sampled_S, is_greedy_S, smd.seeds,
                                             smd.steps - m_S)
            # Raw logprobs of the token emitted at each verify row (the bonus row's are the
            # sampler's own).
            emitted_R = tokens_SP[:, :K].reshape(-1)
            logprobs = jax.lax.cond(
                jnp.any(smd.num_logprobs >= 0),
                lambda: gather_logprobs(jax.nn.log_softmax(raw_RV(), axis=-1), emitted_R,
                                        topk),
                lambda: zero_logprobs(emitted_R, topk))
            return tokens_SP, num_S, logprobs

        def plain():
            tokens_SP = jnp.zeros((S, K + 1), jnp.int32).at[:, 0].set(step.sampled_S)
            return tokens_SP, one_S, zero_logprobs(jnp.zeros(S * K, jnp.int32), topk)

        hooks.recorded[self.name] = jax.lax.cond(jnp.any(m_S > 0), verify, plain)

    def step_output(self, hooks):
        return hooks.recorded.get(self.name)

    def sampled_tokens(self, record, value, tokens_SP, num_S):
        tokens_SP, num_S = jax.device_get(value[:2])
        return np.asarray(tokens_SP), np.asarray(num_S)

    def sampled_logprobs(self, record, value, logprobs, sampled):
        """Row i's LogprobsLists: one row per emitted token, the verify rows' for the drafts
        and the recovered token, the sampler's own for the bonus."""
        tensors = None
        for i, m in enumerate(record):
            if not m or logprobs[i] is None:
                continue
            if tensors is None:
                tensors = jax.device_get(value[2])
            n = len(sampled[i])
            want = len(logprobs[i].logprob_token_ids[0]) - 1
            spec = logprobs_lists(tensors, [i * self.k + j for j in range(min(n, m))], want)
            bonus = logprobs[i] if n > m else LogprobsLists([], [], [])
            logprobs[i] = LogprobsLists(spec.logprob_token_ids + bonus.logprob_token_ids,
                                        spec.logprobs + bonus.logprobs,
                                        spec.sampled_token_ranks + bonus.sampled_token_ranks)
        return logprobs


def spec_decode_features(config, num_slots: int, vocab_size: int, max_logprobs: int = 20
                         ) -> tuple[StepFeature, ...]:
    """The engine's verification feature for a SpeculativeConfig (none when it is None)."""
    if config is None:
        return ()
    return (SpecDecodeFeature(num_slots, config.num_speculative_tokens, vocab_size,
                              max_logprobs),)
