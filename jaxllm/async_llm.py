"""AsyncLLM: the asyncio front end, with vLLM's names (`AsyncLLMEngine` is the same class).

Owns the engine loop's thread and the streams between it and asyncio: each request's outputs
go to its own asyncio queue, in order, as the engine emits them. Never runs a model step on
the event loop, and never lets one stream's failure reach another.

    event loop (asyncio)                          engine thread
    generate(): check + tokenize, reserve the     loop: take commands (admit, abort)
      request's ids (ValueError here, before            LLMEngine.step()  -- device work
      anything is queued)                               outputs -> each request's queue
      -> command "admit"  ------------------->
    async for out in stream  <--- call_soon_threadsafe ---

Request ids are checked once, by the `RequestIds` the engine shares (engine/request_ids.py):
it holds every parent and child id from `generate` until the engine thread has finished the
request, so a request admitted but not yet applied by the engine thread counts too.

Why a thread and not a process: the engine's device step runs without the GIL, and with
async scheduling its host work overlaps the device (benchmarks/serve.py measures serving
against offline throughput; the choice is recorded there).

If the engine loop itself raises (not a failed step, which only fails its own requests), the
engine is dead: every waiting stream gets `EngineDeadError`, and so does every later call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from jaxllm.config import EngineConfig
from jaxllm.engine.core import StepFailed
from jaxllm.engine.processor import PromptInput, parse_prompt
from jaxllm.llm_engine import LLMEngine
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can run any more."""


@dataclasses.dataclass(frozen=True)
class AsyncEngineArgs(EngineConfig):
    """The engine arguments of `AsyncLLM.from_engine_args`: the same fields as `LLM(...)`."""


@dataclasses.dataclass(eq=False)  # hashed by identity: one stream per request
class _Stream:
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


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, use_tqdm: bool = False):
        self.engine = LLMEngine(config, use_tqdm=use_tqdm)
        # Streams of unfinished requests: every one hears of the engine's death. Which stream
        # a request's outputs go to is the engine thread's (_streams), set when it admits the
        # request, so an id reused right after its request finished never receives (or aborts)
        # the old request's outputs.
        self._live: set[_Stream] = set()
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._engine_loop, name="jaxllm-engine-loop",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig, **kwargs) -> "AsyncLLM":
        return cls(engine_args, **kwargs)

    # ---- the user's side ---------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self.errored

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (per its `output_kind`). The prompt is a str, a
        {"prompt"} / {"prompt_token_ids"} dict, or a PromptInput. Bad input raises ValueError
        here, before anything is queued. Cancelling the consumer aborts the request.
        priority: lower is served first (needs scheduling_policy="priority" unless 0)."""
        self._check_alive()
        prompt = prompt if isinstance(prompt, PromptInput) else parse_prompt(prompt)
        params = sampling_params if sampling_params is not None else SamplingParams()
        engine = self.engine
        processed = engine.processor.process(prompt, params, priority=priority)
        request_id, = engine.request_ids.reserve([(request_id, params.n)])
        fanned = engine.processor.fan_out(processed, request_id)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._live.add(stream)
        self._send("admit", (fanned, stream))
        finished = False
        try:
            self._check_alive()  # the loop may have died before it could see this stream
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._live.discard(stream)
            stream.closed = True
            if not finished and not self.errored:
                self._send("drop", (request_id, stream))  # the consumer went away

    async def chat(self, messages, sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, *, chat_template: str | None = None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   chat_template_kwargs: dict[str, Any] | None = None, priority: int = 0
                   ) -> AsyncIterator[RequestOutput]:
        """`generate` on one conversation rendered by the model's chat template."""
        self._check_alive()
        prompt, = self.engine.processor.render_chat(
            [messages], chat_template, add_generation_prompt, continue_final_message,
            chat_template_kwargs)
        async for out in self.generate(prompt, sampling_params, request_id, priority):
            yield out

    async def abort(self, request_id) -> None:
        """Abort a request (a parent id aborts all its children); its stream ends with a
        finish_reason "abort" output."""
        self._send("abort", [request_id] if isinstance(request_id, str) else list(request_id))

    def get_metrics(self):
        return self.engine.get_metrics()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, on the engine thread; False while requests hold
        blocks."""
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send("call", (self.engine.reset_prefix_cache, done))
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError("the engine loop has died") from self.dead_error
        if self._stop:
            raise EngineDeadError("the engine has been shut down")

    def _send(self, command: str, payload) -> None:
        self._commands.put((command, payload))
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------

    def _engine_loop(self) -> None:
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
                    for request_id in failure.request_ids:
                        self._deliver(request_id, failure)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as e:  # the loop itself broke: nothing can run any more
            logger.exception("the engine loop died")
            self.dead_error = e
            dead = EngineDeadError(f"the engine loop died: {type(e).__name__}: {e}")
            dead.__cause__ = e
            for stream in list(self._live):
                stream.put(dead)

    def _apply_commands(self) -> None:
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "admit":
                fanned, stream = payload
                self._streams[fanned.request_id] = stream
                self.engine.admit(fanned)
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
            else:
                self._abort(payload)

    def _abort(self, request_ids: list[str]) -> None:
        for out in self.engine.abort_now(request_ids):
            self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        """On the engine thread: hand an output (or a failure) to its request's stream."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        stream.put(item)


AsyncLLMEngine = AsyncLLM
