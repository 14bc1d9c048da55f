"""`jaxllm serve` with engine faults armed, for the tests that need the server's own process
(test_load.py, test_shutdown.py).

Run as `python fault_server.py serve ARGS`: the same server as `jaxllm serve ARGS`, except that
in each engine replica
  - the first model step carrying a request whose id starts with "fault" raises, once (the
    runner's dispatch, as a device failure would): that step's requests fail, the engine
    goes on;
  - a step with a running request whose id starts with "die" kills the engine loop itself
    (an error outside any step's own handling): the engine is dead;
  - with JAXLLM_TEST_STEP_DELAY_S set, every model step takes that many seconds longer (so
    that requests of the tiny model stay in flight long enough to be interrupted).
The server runs in its own process, so that /health latencies measured against it are the
server's alone.
"""

from __future__ import annotations

import os
import sys
import time

from jaxllm import async_llm
from jaxllm.entrypoints.cli import main


class InjectedFault(RuntimeError):
    pass


def arm(engine) -> None:
    runner, step = engine.runner, engine.step
    dispatch = runner.dispatch
    armed = [True]
    delay = float(os.environ.get("JAXLLM_TEST_STEP_DELAY_S", "0"))

    def faulty_dispatch(so):
        if armed[0] and any(r.startswith("fault") for r in so.num_scheduled_tokens):
            armed[0] = False
            raise InjectedFault("the load test's injected engine fault")
        time.sleep(delay)
        return dispatch(so)

    def dying_step():
        if any(r.request_id.startswith("die") for r in engine.scheduler.running):
            raise MemoryError("the injected death of the engine loop")
        return step()

    runner.dispatch = faulty_dispatch
    engine.step = dying_step


_init = async_llm.AsyncLLM.__init__


def _init_armed(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    for engine in self.engines:
        arm(engine)


if __name__ == "__main__":
    async_llm.AsyncLLM.__init__ = _init_armed
    main(sys.argv[1:])
