"""What runs this step, and what gets preempted: vLLM v1's single token-budget scheduler.

This file owns the waiting and running queues and turns them into one `SchedulerOutput` per
step, then folds the runner's sampled tokens back into the requests. It never touches
devices, never builds arrays, and never hands a `Request` to the runner.

There are no prefill and decode phases. Every step has one budget of
`max_num_batched_tokens`, spent in this order:

  1. running requests, in order: each asks for `num_tokens - num_computed_tokens` (a whole
     prompt chunk, or the one token sampled last step), capped by what is left of the budget.
     If its blocks cannot grow, running requests are preempted (by recompute: blocks freed,
     progress reset, sent back to `waiting`) until it fits; if it is itself the victim, it
     preempts itself (and the requests behind it still get their turn). The victim is the
     policy's (engine/request_queue.py): the *tail* of `running` with "fcfs"; with
     "priority" the largest (priority, arrival), which may be a request already scheduled
     this step (its tokens are then given back to the budget).
  2. waiting requests, in the policy's order (first come first served, or by priority then
     arrival), while fewer than `max_num_seqs` run and no one was preempted this step. Each
     first takes its longest cached prefix of full blocks (prefix caching; a resumed request
     too), then asks for the rest. A prompt bigger than
     the rest of the budget gets a partial chunk (chunked prefill) and finishes it in later
     steps as a running request.

A waiting request with a prefix-cache hit (block_size 4, prompt of 11, budget 5):

    positions:  0  1  2  3 | 4  5  6  7 | 8  9 10
                <---- cache hit -----> | <-- 3 scheduled (the rest of the prompt)
    num_computed_tokens 0 -> 8 (the hit), then -> 11 when scheduled; budget spent: 3

Blocks are offered to the prefix cache when they are scheduled, not when computed, so the
n > 1 children of one prompt admitted in the same step share its blocks: the first computes
them, the others hit them (the model step writes every row's K/V before any row reads).

`num_computed_tokens` advances as soon as tokens are scheduled, so a step's outputs only add
sampled tokens; a request whose chunk ended mid-prompt gets none. A step that will sample for
a request also gives it an output placeholder, turned into the real token by
`update_from_output`. In the synchronous loop that happens before the next schedule(); with
async scheduling the next step is scheduled first, and its placeholder row is fed on the
device from the previous step's sample. A request whose placeholders already reach its
max_tokens or max_model_len is not scheduled again: its last token is in flight.

Structured outputs (engine/structured_output.py): a waiting request whose grammar still
compiles is stepped over (vLLM's WAITING_FOR_FSM); a constrained request is not scheduled
while a token of its is in flight; the constrained requests that sample this step get their
bitmask rows in the SchedulerOutput, and their matchers take the tokens in
`update_from_output` (a refused token fails the request).

One request's failure is its own (engine/request_failures.py): if scheduling or updating it
raises, it alone finishes with an error and the step goes on without it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.metrics import SchedulerStats
from jaxllm.engine.request import Request, RequestStatus, check_stop
from jaxllm.engine.request_failures import FAILED, RequestFailures
from jaxllm.engine.request_queue import create_request_queue
from jaxllm.engine.scheduler_invariants import check_invariants
from jaxllm.engine.structured_output import StructuredOutputManager
from jaxllm.lora.scheduling import admits_lora
from jaxllm.spec_decode.scheduling import NoSpecDecoding, rows_for
from jaxllm.messages import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        structured_output_manager: StructuredOutputManager | None = None,
        spec_decoding: NoSpecDecoding | None = None,
        max_loras: int | None = None,
    ) -> None:
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_model_len > kv_cache_manager.max_model_len:
            raise ValueError(f"max_model_len={max_model_len} exceeds the KV cache manager's "
                             f"max_model_len={kv_cache_manager.max_model_len}")
        self.kv_cache_manager = kv_cache_manager
        # Grammars and their bitmasks (engine/structured_output.py); None: refused.
        self.structured_output_manager = structured_output_manager
        # Speculative decoding's drafts and rollback (jaxllm/spec_decode/scheduling.py).
        self.spec_decoding = spec_decoding or NoSpecDecoding()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_loras = max_loras  # distinct adapters running at once (None: no LoRA)

        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # WAITING or PREEMPTED, in the order they will be scheduled (the policy's).
        self.waiting = create_request_queue(policy)
        self.running: list[Request] = []  # RUNNING, in order of admission
        self._num_added = 0  # requests ever added: each one's arrival_order
        # Finished since the last schedule(): the next SchedulerOutput tells the runner.
        self.finished_req_ids: set[str] = set()
        # Preempted outside schedule() (preempt_all): the next SchedulerOutput tells the runner.
        self._preempted_req_ids: set[str] = set()
        # Requests whose own scheduling or update raised, failed alone (request_failures.py).
        self.failures = RequestFailures(self.fail_requests)

        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Prefix cache, in tokens (vLLM's counters): tokens looked up, and tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The latest schedule()'s output, for reading from outside (notebooks, debugging:
        # who ran how many tokens with which blocks); the engine never reads it back.
        self.last_scheduler_output: SchedulerOutput | None = None

    # -- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} has status "
                             f"{request.status.name}, expected WAITING")
        if request.num_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} prompt "
                             f"tokens, more than max_model_len={self.max_model_len}")
        self.requests[request.request_id] = request
        request.arrival_order = self._num_added
        self._num_added += 1
        constraint = getattr(request.sampling_params, "structured_outputs", None)
        if constraint is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured_outputs needs an engine with structured outputs")
            request.structured_output_request = \
                self.structured_output_manager.grammar_init(constraint)
        self.kv_cache_manager.update_block_hashes(request)  # the prompt's full blocks
        self.waiting.add_request(request)

    def finish_requests(self, req_ids: str | Iterable[str], finished_status: RequestStatus
                        ) -> None:
        """End requests from outside (abort, stop string). Unknown or finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError("finished_status must be a FINISHED_* status, got "
                             f"{finished_status!r}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._free_request(request)

    def fail_requests(self, req_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish requests whose step raised (FINISHED_ERROR), free their blocks, and return
        their final outputs. Ids that already finished are skipped."""
        outputs = []
        for req_id in req_ids:
            if req_id not in self.requests:
                continue
            self.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(req_id=req_id, new_token_ids=[],
                                            finish_reason="error", stop_reason=None))
        return outputs

    def preempt_all(self) -> None:
        """Send every running request back to waiting to recompute (after the device lost its
        KV cache), tail first so that with "fcfs" the oldest resumes first. The cached
        prefixes were in that KV cache too: they are forgotten."""
        while self.running:
            request = self.running.pop()
            self._preempt(request)
            self._preempted_req_ids.add(request.request_id)
        reset = self.kv_cache_manager.reset_prefix_cache()
        assert reset, "blocks still held after preempting every running request"

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache). Refused, returning False,
        while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []  # first time, or resumed after preemption
        preempted: list[Request] = []

        self.spec_decoding.begin_step(self.running)
        # 1. Running requests, in order. A victim of preemption before req_index was
        #    scheduled earlier in this step (only the "priority" policy picks those): its
        #    tokens go back to the budget.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            # A request that fails here has left `running`: the next one is at req_index.
            num_new_tokens = self.failures.guard(request, self._num_new_tokens, request, token_budget)
            if num_new_tokens is FAILED:
                continue
            if num_new_tokens == 0:
                req_index += 1
                continue
            num_new_tokens = self.spec_decoding.num_new_tokens(request, num_new_tokens,
                                                               token_budget)
            block_ids = self.failures.guard(request, self.kv_cache_manager.allocate_slots, request,
                                      num_new_tokens)
            while block_ids is None:  # preempt until its blocks fit
                victim = self.waiting.preemption_victim(self.running)
                if self.running.index(victim) < req_index:
                    req_index -= 1
                    if victim.request_id in num_scheduled_tokens:
                        self.kv_cache_manager.uncache_scheduled(victim)
                        scheduled_running.remove(victim)
                        token_budget += num_scheduled_tokens.pop(victim.request_id)
                        del new_block_ids[victim.request_id]
                        self.spec_decoding.forget(victim)
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                block_ids = self.failures.guard(request, self.kv_cache_manager.allocate_slots,
                                          request, num_new_tokens)
            if block_ids is None or block_ids is FAILED:
                # It was the victim: it preempted itself. vLLM stops here; the requests
                # behind it are more important (with "fcfs" there are none), so go on.
                continue
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_block_ids[request.request_id] = block_ids
            token_budget -= num_new_tokens
            req_index += 1

        # 2. Waiting requests, in the policy's order. Skipped after a preemption: blocks are
        #    short, and the preempted requests would only be preempted again. A request
        #    whose grammar still compiles (vLLM's WAITING_FOR_FSM) is stepped over, and
        #    keeps its place.
        waiting_for_fsm: list[Request] = []
        while (not preempted and self.waiting and token_budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting.peek_request()
            ready = self.failures.guard(request, self._grammar_ready, request)
            if ready is FAILED:
                continue  # its grammar failed to compile: it has left `waiting`
            # Stepped over too: an adapter beyond max_loras (jaxllm/lora/scheduling.py).
            if not ready or not admits_lora(request, self.running, self.max_loras):
                waiting_for_fsm.append(self.waiting.pop_request())
                continue
            planned = self.failures.guard(request, self._plan_waiting, request, token_budget)
            if planned is FAILED:
                continue  # it has left `waiting`
            if planned is None:
                break
            num_hit, num_new_tokens = planned
            self.waiting.pop_request()
            self._record_cache_hit(request, num_hit)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = time.time()
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        for request in reversed(waiting_for_fsm):
            self.waiting.prepend_request(request)
        # The messages carry the counts from before this step's tokens.
        new_reqs = [self._new_request_data(r) for r in scheduled_new]
        cached_reqs = [CachedRequestData(r.request_id, new_block_ids[r.request_id],
                                         r.num_computed_tokens,
                                         self.kv_cache_manager.num_blocks_before(
                                             r, len(new_block_ids[r.request_id])))
                       for r in scheduled_running]

        # Advance now, as if the step already ran: the next schedule() must not hand out the
        # same positions again, even before update_from_output. A request whose known (and
        # in-flight) tokens are now all computed samples in this step: one more placeholder.
        constrained: list[Request] = []
        for req_id, num_tokens in num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens >= request.num_tokens_with_placeholders:  # drafts: >
                request.num_output_placeholders += 1
                if request.structured_output_request is not None:
                    constrained.append(request)
        grammar_bitmask = None
        spec_decode_tokens = self.spec_decoding.take_scheduled()
        if constrained:  # the tokens each grammar allows at the position sampled (and drafts)
            grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [r.structured_output_request for r in constrained],
                [spec_decode_tokens.get(r.request_id, []) for r in constrained])
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted} | self._preempted_req_ids,
            blocks_to_copy=self.kv_cache_manager.blocks_to_copy,
            structured_output_request_ids=[r.request_id for r in constrained],
            grammar_bitmask=grammar_bitmask,
            scheduled_spec_decode_tokens=spec_decode_tokens,
        )
        self.kv_cache_manager.blocks_to_copy = []
        self._preempted_req_ids = set()
        self.finished_req_ids = set()
        check_invariants(self, output)
        self.last_scheduler_output = output
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply the stopping rules, free finished requests."""
        index = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        outputs: list[EngineCoreOutput] = []
        stopped: set[Request] = set()
        for req_id in scheduler_output.num_scheduled_tokens:  # the runner's contract
            if req_id in self.requests and req_id not in index:
                raise ValueError(f"the runner output has no entry for scheduled request "
                                 f"{req_id!r}")
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:  # finished from outside after it was scheduled
                continue
            out = self.failures.guard(request, self._update_request, request, index,
                                model_runner_output)
            if out is FAILED:
                continue
            if request.is_finished():
                stopped.add(request)
            if out is not None:
                outputs.append(out)
        if stopped:
            self.running = [r for r in self.running if r not in stopped]
        return outputs

    def _update_request(self, request: Request, index: dict[str, int],
                        model_runner_output: ModelRunnerOutput) -> EngineCoreOutput | None:
        """Fold one request's sampled tokens back; -> its output of this step, if any."""
        req_id = request.request_id
        i = index[req_id]
        sampled = model_runner_output.sampled_token_ids[i]
        if sampled and request.num_stale_outputs:
            # Sampled before this request was preempted; it will be sampled again.
            request.num_stale_outputs -= 1
            return None
        assert not sampled or request.num_output_placeholders, (
            f"{request}: tokens sampled before its prefill completed")
        # One placeholder per sampling step, however many tokens that step produced.
        request.num_output_placeholders -= 1 if sampled else 0
        self.spec_decoding.on_output(request, sampled)  # rejected drafts roll back
        if request.structured_output_request is not None:  # a refused token: it fails
            self.structured_output_manager.accept_tokens(request.structured_output_request,
                                                         sampled)
        new_token_ids = self._append_until_stop(request, sampled)
        prompt_logprobs = model_runner_output.prompt_logprobs.get(req_id)
        activations = model_runner_output.activations.get(req_id)
        if new_token_ids:
            # Blocks that just filled join the prefix cache, before any free below.
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if request.is_finished():
            self._free_request(request)
        if not (new_token_ids or request.is_finished() or prompt_logprobs is not None
                or activations is not None):
            return None
        logprobs = model_runner_output.logprobs
        return EngineCoreOutput(
            req_id=req_id,
            new_token_ids=new_token_ids,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            new_logprobs=None if logprobs is None else rows_for(
                logprobs[i], len(new_token_ids), len(model_runner_output.sampled_token_ids[i])),
            new_prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            new_activations=activations,
            scheduled_time=request.scheduled_time,
            num_preemptions=request.num_preemptions,
        )

    def take_failed_outputs(self) -> list[EngineCoreOutput]:
        """The final outputs (finish_reason "error") of requests that failed on their own since
        the last call."""
        return self.failures.take()

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            spec_decoding=self.spec_decoding.make_stats(),
        )

    # -- helpers ------------------------------------------------------------------------
    def _plan_waiting(self, request: Request, token_budget: int) -> tuple[int, int] | None:
        """Take a waiting request's cached prefix and the blocks for what it computes next;
        -> (tokens found cached, tokens to schedule), or None when its blocks do not fit."""
        computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        tail = self.kv_cache_manager.get_cached_tail(request, num_hit)
        num_hit += tail.num_tokens if tail is not None else 0
        num_new_tokens = self._num_new_tokens(request, token_budget, num_hit)
        if self.kv_cache_manager.allocate_slots(request, num_new_tokens,
                                                computed_blocks, tail) is None:
            return None
        return num_hit, num_new_tokens

    def _num_new_tokens(self, request: Request, token_budget: int,
                        num_computed_tokens: int | None = None) -> int:
        """Tokens to schedule after `num_computed_tokens` (default: the request's; a waiting
        request passes its cache hit)."""
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_tokens = request.num_tokens_with_placeholders
        if request.num_output_placeholders and request.structured_output_request is not None:
            return 0  # its next bitmask needs the token in flight (engine/core.py)
        if request.num_output_placeholders and (
                num_tokens >= self.max_model_len
                or request.num_output_tokens + request.num_output_placeholders
                >= request.max_tokens):
            return 0  # the token in flight is its last
        return min(num_tokens - num_computed_tokens, token_budget,
                   self.max_model_len - num_computed_tokens)

    @staticmethod
    def _grammar_ready(request: Request) -> bool:
        """May it run: no grammar, or its grammar has compiled (raises if that failed)."""
        grammar = request.structured_output_request
        return grammar is None or grammar.is_ready()

    def requests_waiting_for_fsm(self) -> list:
        """The grammars still compiling for waiting requests."""
        return [r.structured_output_request for r in self.waiting
                if r.structured_output_request is not None
                and r.structured_output_request.matcher is None]

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: drop the K/V, keep the tokens (prompt and generated), and
        # prefill them all again when resumed.
        self.kv_cache_manager.free(request)
        self.spec_decoding.forget(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Tokens still in flight were computed on the K/V just dropped: discard them on
        # arrival; the recompute samples those positions again (same seed and step).
        request.num_stale_outputs += request.num_output_placeholders
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _record_cache_hit(self, request: Request, num_hit: int) -> None:
        if request.status == RequestStatus.WAITING:  # first schedule, not a resume
            request.num_cached_tokens = num_hit
        if self.kv_cache_manager.uses_prefix_cache(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _append_until_stop(self, request: Request, sampled: list[int]) -> list[int]:
        """Append tokens one by one; drop whatever follows a stopping token."""
        appended: list[int] = []
        for token_id in sampled:
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += request.num_prompt_tokens
            request.append_output_token_ids(token_id)
            appended.append(token_id)
            if check_stop(request, self.max_model_len):
                break
        self.num_generation_tokens += len(appended)
        return appended

    def _free_request(self, request: Request) -> None:
        assert request.is_finished(), request
        # A failed step may not have written the K/V its requests' blocks were offered for.
        # A request that ended normally leaves its partial last block cached as a tail.
        self.kv_cache_manager.free(
            request, uncache=request.status == RequestStatus.FINISHED_ERROR,
            cache_tail=request.status in (RequestStatus.FINISHED_STOPPED,
                                          RequestStatus.FINISHED_LENGTH_CAPPED))
        self.finished_req_ids.add(request.request_id)
        request.structured_output_request = None  # its matcher goes with it
        del self.requests[request.request_id]
