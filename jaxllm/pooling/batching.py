"""PoolingBatcher: the server's one engine thread, which pools the prompts of every concurrent
request in shared steps (continuous batching for the pooling runner, as vLLM's engine core
batches requests from many clients).

Owns the queue of jobs (a job is one HTTP request's prompts, params and task), the engine
thread, and routing each step's rows back to the job that asked. A job is checked and
tokenized on the engine thread (neither the engine nor the fast tokenizer is thread-safe),
all or nothing: a bad job fails alone and adds no request. Jobs that arrive while a step runs
join the next step. If a step fails, every job with a prompt still in flight fails with that
error and the queue is emptied, so nothing is left behind for later jobs. Never parses request
bodies and never touches the device itself (the engine does).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading

from jaxllm.pooling.engine import PoolingEngine
from jaxllm.pooling.outputs import PoolingRequestOutput
from jaxllm.pooling.params import PoolingParams


@dataclasses.dataclass
class _Job:
    prompts: list
    params: list[PoolingParams]
    task: str
    future: concurrent.futures.Future
    request_ids: list[str] = dataclasses.field(default_factory=list)
    done: dict[str, PoolingRequestOutput] = dataclasses.field(default_factory=dict)

    def finish_row(self, out: PoolingRequestOutput) -> None:
        self.done[out.request_id] = out
        if len(self.done) == len(self.request_ids) and not self.future.done():
            self.future.set_result([self.done[i] for i in self.request_ids])


class PoolingBatcher:
    def __init__(self, engine: PoolingEngine):
        self.engine = engine
        self._new: collections.deque[_Job] = collections.deque()
        self._wake = threading.Condition()
        self._owner: dict[str, _Job] = {}  # request id -> its job, while in flight
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, prompts: list, params: list[PoolingParams],
               task: str) -> concurrent.futures.Future:
        """Queue one job; the future resolves to its outputs in prompt order, or to the
        ValueError that refused it."""
        job = _Job(prompts, params, task, concurrent.futures.Future())
        with self._wake:
            if self._closed:
                raise RuntimeError("the pooling engine has shut down")
            self._new.append(job)
            self._wake.notify()
        return job.future

    async def encode(self, prompts: list, params: list[PoolingParams],
                     task: str) -> list[PoolingRequestOutput]:
        self.start()
        return await asyncio.wrap_future(self.submit(prompts, params, task))

    def start(self) -> None:
        with self._wake:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="jaxllm-pooling",
                                                daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop the engine thread after the step it is running; jobs not finished fail."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        error = RuntimeError("the pooling engine has shut down")
        self._fail_in_flight(error)
        with self._wake:
            queued = list(self._new)
            self._new.clear()
        for job in queued:
            job.future.set_exception(error)

    # ---- the engine thread ----------------------------------------------------------------

    def _take_new(self) -> list[_Job] | None:
        """The jobs queued since the last step; waits for one while nothing is in flight.
        None: closed."""
        with self._wake:
            while not self._new and not self._owner and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            jobs = list(self._new)
            self._new.clear()
            return jobs

    def _admit(self, job: _Job) -> None:
        try:
            requests = self.engine.prepare(job.prompts, job.params, job.task)
        except Exception as e:  # noqa: BLE001 - the job's own error, given back to it
            job.future.set_exception(e)
            return
        for request in requests:
            self.engine.scheduler.add_request(request)
            self._owner[request.request_id] = job
            job.request_ids.append(request.request_id)

    def _fail_in_flight(self, error: BaseException) -> None:
        jobs = {id(j): j for j in self._owner.values()}.values()
        self._owner.clear()
        self.engine.scheduler.waiting.clear()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    def _loop(self) -> None:
        while (jobs := self._take_new()) is not None:
            for job in jobs:
                self._admit(job)
            if not self.engine.scheduler.has_unfinished_requests():
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - every job in flight gets the error
                self._fail_in_flight(e)
                continue
            for out in outs:
                self._owner.pop(out.request_id).finish_row(out)


__all__ = ["PoolingBatcher"]
