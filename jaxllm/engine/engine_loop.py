"""EngineLoop: one engine (one data-parallel replica) stepping on its own thread.

Owns the thread, its command queue (admit, abort, drop, call), and which stream each of its
requests' outputs go to. The front end (jaxllm/async_llm.py) talks to it only through
`send`; everything that touches the engine happens on this thread, in order. Never checks or
routes requests (the front end did), and never imports jax: the engine object does the
device work, and releases the GIL while it does.

    front end (event loop)          this thread
    send("admit", (fanned, stream)) -> streams[id] = stream; engine.admit(fanned)
                                       engine.step() -> outputs -> streams[id].put(out)
    send("drop", (id, stream))      -> abort id only if it is still that stream's request
    send("abort", ids or None)      -> abort those ids (None: every request of this loop)

A request that fails inside the engine ends like any other: its stream gets its final
output, with finish_reason "error" (admission that raises, a failed step, a failure of its
own scheduling, update or output); the loop goes on. If the loop itself raises, it calls
`on_death(exception)` and stops: the front end then fails every stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable

from jaxllm.engine.core import StepFailed
from jaxllm.engine.output_processor import failed_request_output

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)  # hashed by identity: one stream per request
class Stream:
    """One request's outputs, on their way to the asyncio consumer."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    closed: bool = False  # the consumer went away; its request is being dropped

    def put(self, item) -> None:
        """From any thread: hand an output (or an exception) to the consumer, if it is
        still there (outputs may come out of a step before the drop reaches the engine)."""
        if self.closed:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed since: nobody will read this
            self.closed = True


class EngineLoop:
    def __init__(self, engine, on_death: Callable[[BaseException], None], name: str):
        self.engine = engine
        self.on_death = on_death
        # Set when the engine thread admits a request, so that an id reused right after its
        # request finished never receives (or aborts) the old request's outputs.
        self._streams: dict[str, Stream] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, command: str, payload) -> None:
        """From any thread: queue a command for the engine thread."""
        self._commands.put((command, payload))
        self._wake.set()

    def stop(self) -> None:
        """Ask the thread to stop after its current step (returns at once)."""
        self._stop = True
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout=timeout)

    # ---- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    outputs = engine.step()
                except StepFailed as failure:
                    outputs = failure.request_outputs
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as e:  # the loop itself broke: nothing can run here any more
            logger.exception("the engine loop died")
            self.on_death(e)

    def _apply_commands(self) -> None:
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "admit":
                fanned, stream = payload
                self._streams[fanned.request_id] = stream
                try:
                    self.engine.admit(fanned)
                except Exception:  # it left nothing behind (LLMEngine.admit): only it fails
                    logger.exception("admitting request %r failed", fanned.request_id)
                    self._deliver(fanned.request_id, failed_request_output(fanned))
            elif command == "call":
                fn, done = payload
                try:
                    done.set_result(fn())
                except Exception as e:  # the caller gets it; the engine goes on
                    done.set_exception(e)
            elif command == "drop":
                request_id, stream = payload
                if self._streams.get(request_id) is stream:
                    self._abort([request_id])
            else:  # "abort": by the user's ids (None: all), whichever streams they have
                self._abort(list(self._streams) if payload is None else payload)

    def _abort(self, request_ids: list[str]) -> None:
        for out in self.engine.abort_now(request_ids):
            self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        """Hand an output (or a failure) to its request's stream."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        stream.put(item)
