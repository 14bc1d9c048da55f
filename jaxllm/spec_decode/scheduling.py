"""The scheduler's half of speculative decoding: which running rows verify drafts this step,
and what a verified run does to a request afterwards.

Owns the proposals of the step being scheduled (req_id -> drafts), the rollback after
verification and the acceptance counters (vLLM's spec_decode_* metrics). The scheduler
calls it at these points and never branches on whether speculation is on (`NoSpecDecoding`
is the same interface doing nothing):

    begin_step(running)                 how many drafts this step may verify in all
                                        (cost_model.py: the padding of the batch's own
                                        bucket, and a larger bucket only while acceptance
                                        pays for its extra tokens); a draft model proposes
                                        for the rows that may take them, in one batch
    observe_step(num_tokens, seconds)   the engine's measured step time (feeds that model)
    num_new_tokens(request, n, budget)  a running row ready to decode (n == 1) may take
                                        1 + m tokens: its last token and m <= K drafts
    forget(request)                     its drafts leave the step (preempted, unscheduled)
    take_scheduled()                    -> SchedulerOutput.scheduled_spec_decode_tokens
    on_output(request, sampled)         before its tokens are appended: roll back the
                                        rejected drafts and free blocks that held only them

Token ranges of a row with 3 drafts (num_tokens 10 before the step):

    scheduled:   t9 d0 d1 d2           num_computed 9 -> 13 at schedule
    verified:    d0 accepted, d1 rejected -> sampled [d0, r1]
    after:       num_computed 13 - 2 rejected = 11 (t9 and d0 computed); tokens 12

A row gets drafts only when verifying them cannot change what its sampler would do: no
penalties, bad words, allowed ids, logit bias or research extras (logprobs only in the
raw_logprobs mode), and past min_tokens (the verify positions skip those processors:
spec_decode/feature.py). A row with a grammar keeps only the leading drafts its grammar
accepts; the scheduler then sends the grammar's mask at each verify position
(engine/structured_output.py grammar_bitmask); checking drafts leaves the matcher where it is.
Never touches a device.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxllm.engine.request import CACHE_SALT_KEY
from jaxllm.engine.structured_output import StructuredOutputManager
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.cost_model import UNLIMITED, StepCostModel
from jaxllm.spec_decode.ngram import NgramProposer


@dataclasses.dataclass(frozen=True)
class SpecDecodingStats:
    """Cumulative counters (vLLM's names without the prefix)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified run, the bonus/recovered one included (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def may_speculate(params, raw_logprobs: bool = True) -> bool:
    """Does the request's sampling leave the verify positions plain (see the docstring)?
    raw_logprobs: the engine's logprobs_mode is raw_logprobs (the verify rows' logprobs are
    raw; in the processed modes a request asking for logprobs gets no drafts)."""
    extra = {k for k in (params.extra_args or {}) if k != CACHE_SALT_KEY}
    return not (params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0 or params.bad_words
                or params.allowed_token_ids or params.logit_bias
                or (params.logprobs is not None and not raw_logprobs)
                or params.logits_processors or extra)


class NoSpecDecoding:
    """Speculation off: every call leaves the schedule as it is."""

    stats = None

    def num_new_tokens(self, request, num_new_tokens: int, token_budget: int) -> int:
        return num_new_tokens

    def forget(self, request) -> None:
        pass

    def begin_step(self, running: list) -> None:
        pass

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        pass

    def take_scheduled(self) -> dict[str, list[int]]:
        return {}

    def on_output(self, request, sampled: list[int]) -> None:
        pass

    def make_stats(self) -> SpecDecodingStats | None:
        return None

    def shutdown(self) -> None:
        pass


class SpecDecodeScheduling(NoSpecDecoding):
    def __init__(self, config: SpeculativeConfig, kv_cache_manager, max_model_len: int,
                 logprobs_mode: str = "raw_logprobs", max_num_batched_tokens: int = 8192,
                 proposer=None):
        """proposer: the draft model's (draft_model.py); None: n-gram lookup (ngram.py)."""
        self.k = config.num_speculative_tokens
        self.proposer = proposer or NgramProposer(self.k, config.prompt_lookup_min,
                                                  config.prompt_lookup_max)
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.raw_logprobs = logprobs_mode == "raw_logprobs"
        self.auto_disable = config.auto_disable
        self._drafts: dict[str, list[int]] = {}  # the step being scheduled
        self._verifying: dict[str, int] = {}  # req_id -> drafts it verifies in flight
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = np.zeros(self.k, np.int64)
        # Per step: how many drafts (cost_model.py; observe_step feeds it)
        self.cost_model = StepCostModel(max_num_batched_tokens, (1 + self.k,))  # llm_engine
        self.draft_budget = UNLIMITED  # drafts the step being scheduled may still take
        self.num_steps_off = 0  # steps the cost model kept in their own bucket
        self.num_proposals = 0  # proposals asked for the full k (the cost model's supply),
        self.num_hits = 0  # those that offered drafts,
        self.num_proposed_tokens = 0  # and how many
        self._proposal_seconds = 0.0  # the proposer's time in the step being scheduled

    @property
    def active(self) -> bool:
        return self.draft_budget > 0

    def begin_step(self, running: list) -> None:
        """Set the draft budget of the step being scheduled, with the `running` requests;
        a draft model proposes for the rows that may take drafts, all at once."""
        self._set_budget(len(running))
        rows = ([r for r in running if self._may_draft(r)][:-(-self.draft_budget // self.k)]
                if self.draft_budget > 0 and self.proposer.proposes_ahead else [])
        t0 = time.perf_counter()
        self.proposer.begin_step(rows)
        # Its time is the proposer's, not the step's (cost_model.py weighs it per row).
        self._proposal_seconds = time.perf_counter() - t0
        self.cost_model.observe_proposal(len(rows), self._proposal_seconds)

    def _may_draft(self, request) -> bool:
        return (not request.num_output_placeholders
                and request.num_computed_tokens == request.num_tokens - 1
                and request.num_output_tokens >= request.sampling_params.min_tokens
                and request.num_tokens + 1 < min(request.num_prompt_tokens + request.max_tokens,
                                                 self.max_model_len)
                and may_speculate(request.sampling_params, self.raw_logprobs))

    def _set_budget(self, num_running: int) -> None:
        if not self.auto_disable:
            self.draft_budget = UNLIMITED
            return
        # Until proposals ran, assume every row offers k drafts; until drafts were
        # verified, that half of them are accepted.
        hit_rate = self.num_hits / self.num_proposals if self.num_proposals else 1.0
        per_hit = self.num_proposed_tokens / self.num_hits if self.num_hits else self.k
        rate = (self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens
                else 0.5)
        self.draft_budget, own = self.cost_model.draft_budget(num_running, hit_rate, per_hit,
                                                              rate)
        self.num_steps_off += own

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost_model.observe(num_tokens, seconds - self._proposal_seconds)
        self._proposal_seconds = 0.0

    def num_new_tokens(self, request, num_new_tokens: int, token_budget: int) -> int:
        self.forget(request)
        if not self.active or num_new_tokens != 1 or not self._may_draft(request):
            return num_new_tokens
        # The step emits up to m + 1 tokens: stay within max_tokens and max_model_len.
        cap = min(self.k, token_budget - 1,
                  request.max_tokens - request.num_output_tokens - 1,
                  self.max_model_len - request.num_tokens - 1)
        if cap <= 0:
            return num_new_tokens
        drafts = self.proposer.propose_for(request, cap)
        grammar = request.structured_output_request
        if grammar is not None and drafts.size:  # only what the grammar accepts
            drafts = drafts[:StructuredOutputManager.validate_drafts(grammar, drafts)]
        if cap == self.k:
            self.num_proposals += 1
            self.num_hits += drafts.size > 0
            self.num_proposed_tokens += drafts.size
        drafts = drafts[:self.draft_budget]
        self.draft_budget -= drafts.size
        if drafts.size == 0:
            return num_new_tokens
        self._drafts[request.request_id] = drafts.tolist()
        return 1 + drafts.size

    def forget(self, request) -> None:
        self.draft_budget += len(self._drafts.pop(request.request_id, ()))

    def take_scheduled(self) -> dict[str, list[int]]:
        drafts, self._drafts = self._drafts, {}
        # Synchronous loop: the previous step's outputs were all folded back by now.
        self._verifying = {req_id: len(d) for req_id, d in drafts.items()}
        return drafts

    def on_output(self, request, sampled: list[int]) -> None:
        m = self._verifying.pop(request.request_id, 0)
        if not m or not sampled:
            return
        accepted = len(sampled) - 1
        request.num_computed_tokens -= m - accepted
        self.kv_cache_manager.free_blocks_after(request, request.num_computed_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += m
        self.num_accepted_tokens += accepted
        self.accepted_per_pos[:accepted] += 1

    def shutdown(self) -> None:
        self.proposer.shutdown()  # a draft model's engine

    def make_stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens,
                                 tuple(int(x) for x in self.accepted_per_pos))


def make_spec_scheduling(config: SpeculativeConfig | None, kv_cache_manager,
                         max_model_len: int, logprobs_mode: str = "raw_logprobs",
                         max_num_batched_tokens: int = 8192,
                         proposer=None) -> NoSpecDecoding:
    if config is None:
        return NoSpecDecoding()
    return SpecDecodeScheduling(config, kv_cache_manager, max_model_len, logprobs_mode,
                                max_num_batched_tokens, proposer)


def rows_for(logprobs, num_kept: int, num_sampled: int):
    """A step's LogprobsLists cut to the tokens the request kept (a stop inside an accepted
    run drops the rest); as it is (opaque) when every sampled token was kept."""
    if logprobs is None or num_kept >= num_sampled:
        return logprobs
    num_tokens = num_kept
    return dataclasses.replace(logprobs,
                               logprob_token_ids=logprobs.logprob_token_ids[:num_tokens],
                               logprobs=logprobs.logprobs[:num_tokens],
                               sampled_token_ranks=logprobs.sampled_token_ranks[:num_tokens])
