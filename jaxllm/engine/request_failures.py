"""One request's failure inside the scheduler, kept to that request.

Owns: running a step of one request's own scheduling or update (its token count, its blocks,
its new tokens) so that an exception finishes that request alone, through the scheduler's
`fail_requests` (finish_reason "error", blocks freed and uncached: their K/V may never have
been written), and holding its final output until the engine core takes it. Never decides
what runs, never retries, and never catches a failure that is not one request's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from jaxllm.engine.request import Request
from jaxllm.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

FAILED = object()  # what `guard` returns when the request's own call raised


class RequestFailures:
    def __init__(self, fail_requests: Callable[[list[str]], list[EngineCoreOutput]]):
        self._fail_requests = fail_requests
        self._outputs: list[EngineCoreOutput] = []

    def guard(self, request: Request, call, *args):
        """call(*args); if it raises, `request` alone finishes with an error and this returns
        FAILED (the request has then left the scheduler's queues)."""
        try:
            return call(*args)
        except Exception as error:
            logger.error("request %r failed in the scheduler (%s: %s); it finishes with an "
                         "error and the step goes on without it", request.request_id,
                         type(error).__name__, error, exc_info=error)
            self._outputs += self._fail_requests([request.request_id])
            return FAILED

    def take(self) -> list[EngineCoreOutput]:
        """The final outputs of requests that failed since the last call."""
        taken, self._outputs = self._outputs, []
        return taken
