"""`jaxllm serve` with one engine fault armed, for the load test (test_load.py).

Run as `python fault_server.py serve ARGS`: the same server as `jaxllm serve ARGS`, except
that the first model step carrying a request whose id starts with "fault" raises, once, in
each engine replica (the runner's dispatch, as a device failure would). The server runs in
its own process, so that /health latencies measured against it are the server's alone.
"""

from __future__ import annotations

import sys

from jaxllm import async_llm
from jaxllm.entrypoints.cli import main


class InjectedFault(RuntimeError):
    pass


def arm(runner) -> None:
    dispatch = runner.dispatch
    armed = [True]

    def faulty_dispatch(so):
        if armed[0] and any(r.startswith("fault") for r in so.num_scheduled_tokens):
            armed[0] = False
            raise InjectedFault("the load test's injected engine fault")
        return dispatch(so)

    runner.dispatch = faulty_dispatch


_init = async_llm.AsyncLLM.__init__


def _init_armed(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    for engine in self.engines:
        arm(engine.runner)


if __name__ == "__main__":
    async_llm.AsyncLLM.__init__ = _init_armed
    main(sys.argv[1:])
