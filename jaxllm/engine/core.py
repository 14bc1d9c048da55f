"""EngineCore: the scheduler and the runner, and the step loop between them.

Owns `step()` (schedule, execute, update), in two modes, and what happens when a step fails.
Takes `EngineCoreRequest`s, gives back `EngineCoreOutput`s; never tokenizes, detokenizes or
builds user-facing outputs (that is the front end's), and never validates user input.

Synchronous (async_scheduling=False): each step is scheduled, run and folded back before the
next is scheduled.

Async (async_scheduling=True, vLLM's async scheduler): step N+1 is scheduled and dispatched
before step N's sampled tokens reach the host, so the host's scheduling, packing and output
processing overlap the device. Placeholder tokens are fed on the device (runner/step.py).

    call k:    schedule N+1 | dispatch N+1 | fetch N (wait) | update from N -> outputs of N
    device:    ....... N ........ | ........ N+1 ........

Structured outputs under async scheduling: a constrained request's bitmask for step N+1 is
the grammar's state after step N's token, which the host does not have yet. So before
scheduling, a step in flight that sampled for a constrained request is folded back first
(`_constrained_in_flight`): steps with constrained rows run as in the synchronous loop (the
device idles while the host schedules and fills masks), every other step stays async. The
scheduler also never schedules a constrained request with a token in flight.

    unconstrained only:  schedule N+1 | dispatch N+1 | fetch N
    constrained in N:    fetch N | schedule N+1 (masks) | dispatch N+1

A step that raises fails the requests it carried, not the engine: they finish with
finish_reason "error", their blocks are freed, and the exception reaches the caller with the
failed request ids attached. Everything else keeps running. A request whose own scheduling or
update raises fails alone (engine/scheduler.py): its "error" output comes out of the step like
any other output.
"""

from __future__ import annotations

import collections
import logging
import time

from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import Scheduler
from jaxllm.messages import EngineCoreOutput, EngineCoreRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step raised: `outputs` are the final (finish_reason "error") outputs of the requests
    it carried (`req_ids`, engine-core ids); `__cause__` is the original exception. The
    front end sets `request_ids` to the user-level ids that failed and `request_outputs` to
    the user-level outputs the step owes (their final "error" outputs among them)."""

    def __init__(self, outputs: list[EngineCoreOutput], cause: BaseException):
        ids = [o.req_id for o in outputs]
        super().__init__(f"a model step failed ({type(cause).__name__}: {cause}); requests "
                         f"finished with an error: {ids}")
        self.outputs = outputs
        self.req_ids = ids
        self.request_ids: list[str] = ids
        self.request_outputs: list = []


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner, async_scheduling: bool = False):
        self.scheduler = scheduler
        self.runner = runner
        self.async_scheduling = async_scheduling
        # Async mode: dispatched steps whose outputs are not folded back yet (at most 2).
        self._in_flight: collections.deque = collections.deque()

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(request.request_id, request.prompt_token_ids,
                                           request.sampling_params, request.eos_token_id,
                                           request.arrival_time, request.priority))

    def abort_requests(self, req_ids) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids, status: RequestStatus) -> None:
        self.scheduler.finish_requests(req_ids, status)

    def has_unfinished_requests(self) -> bool:
        # A step in flight whose requests all finished since (aborted, failed) has nothing
        # left to deliver: forget it rather than wait for it.
        live = self.scheduler.requests
        while self._in_flight and not any(r in live for r in
                                           self._in_flight[0][0].num_scheduled_tokens):
            self._in_flight.popleft()
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        outputs = self._step_async() if self.async_scheduling else self._step_sync()
        return self.scheduler.take_failed_outputs() + outputs

    def _step_sync(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        so = self._schedule()
        try:
            runner_output = self.runner.execute_model(so)
        except Exception as e:
            raise self._fail(so, e) from e
        outputs = self.scheduler.update_from_output(so, runner_output)
        # Speculative decoding's cost model reads the step times, host work included
        # (spec_decode/cost_model.py).
        self.scheduler.spec_decoding.observe_step(so.total_num_scheduled_tokens,
                                                  time.perf_counter() - t0)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        if so.is_empty and not self._in_flight:
            # Nothing runs but grammars compiling: wait for one rather than spin.
            compiling = self.scheduler.requests_waiting_for_fsm()
            if compiling:
                self.scheduler.structured_output_manager.wait_for_any(compiling, 0.05)
        return so

    def _constrained_in_flight(self) -> bool:
        live = self.scheduler.requests
        return any(r in live for so, _ in self._in_flight
                   for r in so.structured_output_request_ids)

    def _step_async(self) -> list[EngineCoreOutput]:
        outputs = []
        while self._constrained_in_flight():  # their next masks need these tokens
            outputs += self._fetch_oldest()
        so = self._schedule()
        try:
            pending = self.runner.dispatch(so)
        except Exception as e:
            raise self._fail(so, e) from e
        if pending is not None:
            self._in_flight.append((so, pending))
        if outputs or not self._in_flight or (pending is not None
                                              and len(self._in_flight) < 2):
            return outputs  # keep one step in flight; nothing more is due yet
        return self._fetch_oldest()

    def _fetch_oldest(self) -> list[EngineCoreOutput]:
        so, pending = self._in_flight.popleft()
        try:
            runner_output = self.runner.fetch(pending)
        except Exception as e:
            raise self._fail(so, e) from e
        return self.scheduler.update_from_output(so, runner_output)

    def _fail(self, so: SchedulerOutput, cause: BaseException) -> StepFailed:
        """Finish the failed step's requests with an error and make the engine usable again."""
        failed = list(so.num_scheduled_tokens)
        if self._in_flight and not self.runner.device_state_ok():
            # The device state was consumed by the failed computation: steps still in flight
            # read it too, so their requests fail with it.
            for other, _ in self._in_flight:
                failed += [r for r in other.num_scheduled_tokens if r not in failed]
            self._in_flight.clear()
        # With them, the requests that failed alone in this step's schedule.
        outputs = self.scheduler.take_failed_outputs() + self.scheduler.fail_requests(failed)
        if not self.runner.device_state_ok():
            # The KV cache and token history are gone: start them over and let every
            # request still running recompute what it had (as after a preemption).
            logger.warning("resetting the KV cache after a failed step; %d running requests "
                           "will recompute", len(self.scheduler.running))
            self.runner.reset_device_state()
            self.scheduler.preempt_all()
        logger.error("step failed (%s: %s); finished with an error: %s", type(cause).__name__,
                     cause, [o.req_id for o in outputs])
        return StepFailed(outputs, cause)
