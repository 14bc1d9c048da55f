"""The executor of a multi-process engine: every process runs the same steps, in the same order.

Owns the leader's side (`DistributedExecutor`, what `EngineCore` calls instead of the runner)
and the followers' side (`follow`, their loop). Only the leader (process 0) schedules; each
call the engine core makes on its runner is first sent to every follower, which replays it
on its own `ModelRunner`, built from the same arguments:

    leader (EngineCore)                     follower k
    dispatch(so)  -> send ("dispatch", 7, so)  -> runner.dispatch(so)   pending[7]
                     runner.dispatch(so)           (the same jitted step: its collectives
                                                    meet the leader's)
    fetch(p7)     -> ("fetch", 7), sent with   -> runner.fetch(pending.pop(7))
                     the next message
    execute_model(so), reset_device_state()   -> the same call
    shutdown()    -> send ("shutdown",)        -> follow() returns

A fetch moves no data between processes, so it travels with the next call rather than on its
own: with async scheduling that is one message per step (fetch N, dispatch N + 2), and the
follower still replays the calls in the leader's order, which its host-side batch depends on.

So no rank can diverge: followers never schedule, they replay. Fetching on a follower reads
only its addressable copy of the replicated outputs, and keeps its host-side batch (which
the next step's packing reads) equal to the leader's. A step the leader dropped without
fetching (every request it carried had finished) is dropped by followers at the next fetch.

Never validates, schedules or touches a request. A call that raises on the leader raises on
the followers too (same inputs, same program); followers log it and go on, as the leader's
engine core does. A failure on one process only (one device out of memory) cannot be
replayed: the others then wait inside the step's collectives until JAX's coordination
service ends them all (see channel.py's timeouts).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from jaxllm.distributed.channel import Channel

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Dispatched:
    """A step the leader dispatched: its number (followers know it by this) and the runner's
    PendingStep."""

    step: int
    pending: object


class DistributedExecutor:
    """The leader's runner as the engine core sees it."""

    def __init__(self, runner, channel: Channel):
        self.runner = runner
        self.channel = channel
        self._steps = itertools.count()
        self._deferred: list[tuple] = []  # fetches not sent yet
        self._shut_down = False

    def dispatch(self, so) -> Dispatched | None:
        step = next(self._steps)
        self._send("dispatch", step, so)
        pending = self.runner.dispatch(so)
        return None if pending is None else Dispatched(step, pending)

    def fetch(self, dispatched: Dispatched | None):
        if dispatched is None:
            return self.runner.fetch(None)
        self._deferred.append(("fetch", dispatched.step))
        return self.runner.fetch(dispatched.pending)

    def execute_model(self, so):
        self._send("execute_model", so)
        return self.runner.execute_model(so)

    def reset_device_state(self) -> None:
        self._send("reset_device_state")
        self.runner.reset_device_state()

    def device_state_ok(self) -> bool:
        return self.runner.device_state_ok()

    def shutdown(self) -> None:
        """Tell every follower to stop (once; later steps are refused)."""
        if not self._shut_down:
            self._send("shutdown")
            self._shut_down = True
            logger.info("told %d followers to stop", self.channel.num_processes - 1)

    def _send(self, *message) -> None:
        """Send the deferred fetches and this call, in order, as one message."""
        if self._shut_down:
            raise RuntimeError("this multi-process engine has been shut down: its followers "
                               "have stopped")
        self.channel.send([*self._deferred, message])
        self._deferred.clear()


def follow(runner, channel: Channel) -> int:
    """Follower: replay the leader's calls on `runner` until it says stop; -> steps run."""
    pending: dict[int, object] = {}
    steps = 0
    while True:
        for method, *args in channel.recv():
            if method == "shutdown":
                return steps
            steps += _replay(runner, pending, method, args)


def _replay(runner, pending: dict[int, object], method: str, args) -> int:
    """Run one of the leader's calls; -> steps it ran (0 or 1)."""
    try:
        if method == "dispatch":
            step, so = args
            result = runner.dispatch(so)
            if result is None:
                return 0
            pending[step] = result
            return 1
        if method == "fetch":
            step, = args
            for older in [s for s in pending if s < step]:
                del pending[older]  # the leader dropped it unfetched
            runner.fetch(pending.pop(step))
            return 0
        if method == "execute_model":
            runner.execute_model(*args)
            return 1
        if method == "reset_device_state":
            runner.reset_device_state()
            return 0
        raise ValueError(f"unknown executor message {method!r}")
    except Exception:  # the leader's engine core saw the same failure and goes on
        logger.exception("replaying %s failed (as it will have on the leader)", method)
        return 0
