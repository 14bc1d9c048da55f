"""AsyncLLM: the asyncio front end, with vLLM's names (`AsyncLLMEngine` is the same class).

Owns the streams between the engines and asyncio (each request's outputs go to its own
asyncio queue, in order, as its engine emits them), the choice of data-parallel replica for
each request, and what every replica must hear: aborts, prefix-cache resets, death. Never runs
a model step on the event loop (each engine steps on its own thread, engine/engine_loop.py),
and never lets one stream's failure reach another.

    event loop (asyncio)            input thread         engine thread of replica r
    add_requests(): ------------->  check + tokenize     loop: take commands (admit, abort)
      reserve the requests' ids <-  (ValueError here,          LLMEngine.step()  -- device
      (ValueError here), route each  nothing queued)           outputs -> each request's
      to a replica r (dp_router.py)                             queue
      -> command "admit"  ------------------------------->
    async for out in stream  <----------------------- call_soon_threadsafe ---

The event loop never tokenizes or renders a chat template: that work (bounded by the
processor's length checks, but still up to milliseconds per request) runs on one input
thread, as vLLM's async tokenization does, so that /health and every other stream keep
answering while a long prompt is being read. One thread, because a fast tokenizer shared
between threads that tokenize at once is not safe.

Why a thread and not a process: the engine's device step runs without the GIL, and with
async scheduling its host work overlaps the device (benchmarks/serve.py measures serving
against offline throughput; the choice is recorded there). Data parallelism
(`data_parallel_size=N`) is N engines in this process, replica r on devices
[r * tp, (r + 1) * tp), each on its own thread; requests go to the replica that last computed
their prompt's prefix unless it is a batch busier than the least loaded one.

Request ids are checked once, by the `RequestIds` every replica shares
(engine/request_ids.py): it holds every parent and child id from `generate` until an engine
thread has finished the request, so a request admitted but not yet applied counts too.

Every stream ends: with its request's final output (finish_reason "error" when the engine
failed it), or with `EngineDeadError` if an engine loop itself raises (not a failed request,
which fails alone) or the engine shuts down first. After a death the whole front end is dead:
every later call gets `EngineDeadError` too, and the other replicas stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxllm.config import EngineConfig
from jaxllm.engine.dp_router import DPRouter
from jaxllm.engine.engine_loop import EngineLoop, Stream
from jaxllm.engine.processor import FanOut, ProcessedRequest, PromptInput, parse_prompt
from jaxllm.engine.request_ids import RequestIds
from jaxllm.engine.sleep import SLEEP_LEVELS
from jaxllm.llm_engine import LLMEngine
from jaxllm.lora.request import LoRARequest, with_lora_request
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can run any more."""


class EngineSleepingError(RuntimeError):
    """A request came while the engine sleeps (sleep mode); wake_up first."""


@dataclasses.dataclass(frozen=True)
class AsyncEngineArgs(EngineConfig):
    """The engine arguments of `AsyncLLM.from_engine_args`: the same fields as `LLM(...)`."""


class RequestStream:
    """One admitted request's outputs, in order, as an async iterator that ends after its
    finished output (or raises EngineDeadError). Closing it before then, or dropping it
    unread, aborts the request."""

    def __init__(self, owner: "AsyncLLM", request_id: str, replica: int, channel: Stream):
        self.request_id = request_id
        self.finished = False
        self._owner, self._replica, self._channel = owner, replica, channel
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        item = await self._channel.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        """Stop reading: an unfinished request is aborted. Idempotent."""
        if self._closed:
            return
        self._closed = True
        owner = self._owner
        owner._live.discard(self._channel)
        self._channel.closed = True
        owner.router.finished(self._replica)
        if not self.finished and not owner.errored:
            owner.loops[self._replica].send("drop", (self.request_id, self._channel))

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # A stream handed to a response that was never started (its client left first) is
        # only ever garbage: its request must not run on unread.
        self.close()


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, use_tqdm: bool = False):
        self.request_ids = RequestIds()
        self.engines = [LLMEngine(config, use_tqdm=use_tqdm, request_ids=self.request_ids,
                                  data_parallel_rank=rank)
                        for rank in range(config.data_parallel_size)]
        # The processor, tokenizer and configuration are the same in every replica: requests
        # are checked and fanned out by the first one's (one sequence of engine seeds).
        self.engine = self.engines[0]
        resolved = self.engine.config
        self.router = DPRouter(
            len(self.engines), resolved.block_size, max_imbalance=resolved.max_num_seqs,
            capacity=sum(e.kv_cache_manager.num_blocks for e in self.engines),
            prefix_affinity=resolved.enable_prefix_caching)
        self._live: set[Stream] = set()  # streams of unfinished requests: all hear of death
        self._stopped = False
        self._sleeping = False  # sleep mode: requests are refused until wake_up
        self._input_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="jaxllm-input")
        self.dead_error: BaseException | None = None
        self.loops = [EngineLoop(engine, self._died, f"jaxllm-engine-loop-{rank}")
                      for rank, engine in enumerate(self.engines)]

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
        return all(loop.is_alive for loop in self.loops) and not self.errored

    async def offload(self, fn, *args):
        """fn(*args) on the input thread (tokenizing, rendering a chat template), awaited:
        the event loop never does this work itself."""
        return await asyncio.get_running_loop().run_in_executor(
            self._input_thread, functools.partial(fn, *args))

    async def add_requests(self, prompts: Sequence, sampling_params: SamplingParams | None = None,
                           request_ids: Sequence[str | None] | None = None, priority: int = 0,
                           *, check: Callable[[ProcessedRequest], None] | None = None,
                           lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Check, tokenize and queue several requests sharing their parameters, all or
        nothing: -> one RequestStream each, in order. Bad input or an id already in flight
        raises ValueError before anything is queued. priority: lower is served first (needs
        scheduling_policy="priority" unless 0). check: the caller's own admission rule (the
        server's context-fit check), run on each request once it is tokenized, on the input
        thread and before anything is queued; it raises ValueError to refuse. lora_request:
        the adapter of every request (jaxllm/lora/), loaded and checked before queuing."""
        self._check_alive()
        if self._sleeping:
            raise EngineSleepingError("the engine is sleeping: POST /wake_up first")
        prompts = [p if isinstance(p, PromptInput) else parse_prompt(p) for p in prompts]
        params = with_lora_request(
            sampling_params if sampling_params is not None else SamplingParams(), lora_request)
        request_ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        processor = self.engine.processor
        await self.offload(self.engine.lora_manager.check, params)

        def process(prompt: PromptInput) -> ProcessedRequest:
            request = processor.process(prompt, params, priority=priority)
            if check is not None:
                check(request)
            return request

        processed = await self.offload(lambda: [process(p) for p in prompts])
        self._check_alive()
        ids = self.request_ids.reserve([(rid, r.params.n)
                                        for rid, r in zip(request_ids, processed, strict=True)])
        streams = [self._admit(processor.fan_out(r, rid)) for r, rid in zip(processed, ids)]
        if self.errored or self._stopped:  # a loop may have died before it saw these streams
            for stream in streams:
                stream.close()
            self._check_alive()
        return streams

    def _admit(self, request: FanOut) -> RequestStream:
        replica = self.router.route(request.prompt_token_ids)
        channel = Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._live.add(channel)
        self.loops[replica].send("admit", (request, channel))
        return RequestStream(self, request.request_id, replica, channel)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (per its `output_kind`). The prompt is a str, a
        {"prompt"} / {"prompt_token_ids"} dict, or a PromptInput. Bad input raises ValueError
        here, before anything is queued. Cancelling the consumer aborts the request.
        priority: lower is served first (needs scheduling_policy="priority" unless 0)."""
        stream, = await self.add_requests([prompt], sampling_params, [request_id], priority,
                                          lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def render_chat(self, messages, chat_template: str | None = None,
                          add_generation_prompt: bool = True,
                          continue_final_message: bool = False,
                          chat_template_kwargs: dict[str, Any] | None = None,
                          tools: list[dict] | None = None) -> PromptInput:
        """One conversation rendered by a (trusted) chat template and tokenized, on the input
        thread. tools: OpenAI's tool definitions, the template's `tools`."""
        prompt, = await self.offload(
            self.engine.processor.render_chat, [messages], chat_template,
            add_generation_prompt, continue_final_message, chat_template_kwargs, tools)
        return prompt

    async def chat(self, messages, sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, *, chat_template: str | None = None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   chat_template_kwargs: dict[str, Any] | None = None, priority: int = 0,
                   lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """`generate` on one conversation rendered by the model's chat template."""
        self._check_alive()
        prompt = await self.render_chat(messages, chat_template, add_generation_prompt,
                                        continue_final_message, chat_template_kwargs)
        async for out in self.generate(prompt, sampling_params, request_id, priority,
                                       lora_request=lora_request):
            yield out

    async def abort(self, request_id) -> None:
        """Abort a request (a parent id aborts all its children); its stream ends with a
        finish_reason "abort" output."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for loop in self.loops:  # unknown ids are ignored: only the owner acts
            loop.send("abort", ids)

    def abort_all(self) -> None:
        """Abort every request in flight, on every replica (from the event loop's thread, at
        once): each stream ends with a finish_reason "abort" output."""
        for loop in self.loops:
            loop.send("abort", None)

    def get_metrics(self):
        """Every replica's metrics, told apart by their `engine` label (as vLLM's)."""
        return [m for engine in self.engines for m in engine.get_metrics()]

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, in every replica on its engine thread; False if some
        replica refused (requests hold blocks there)."""
        self._check_alive()
        futures = []
        for loop in self.loops:
            done: concurrent.futures.Future = concurrent.futures.Future()
            loop.send("call", (loop.engine.reset_prefix_cache, done))
            futures.append(asyncio.wrap_future(done))
        results = await asyncio.gather(*futures)
        for replica, reset in enumerate(results):
            if reset:
                self.router.forget(replica)
        return all(results)

    async def _on_every_replica(self, method: str, *args) -> list:
        """engine.<method>(*args) on every replica's engine thread, awaited."""
        self._check_alive()
        futures = []
        for loop in self.loops:
            done: concurrent.futures.Future = concurrent.futures.Future()
            loop.send("call", (functools.partial(getattr(loop.engine, method), *args), done))
            futures.append(asyncio.wrap_future(done))
        return await asyncio.gather(*futures)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep mode (engine/sleep.py): from here on requests are refused until
        wake_up. mode: what happens to unfinished requests, "abort" them (vLLM's default) or
        "wait" for them to finish; vLLM's "keep" (hold them across the sleep) is refused."""
        if mode not in ("abort", "wait"):
            raise ValueError(f"mode must be one of ['abort', 'wait'] (vLLM's 'keep' is not "
                             f"supported), got {mode!r}")
        if level not in SLEEP_LEVELS:  # before anything is aborted
            raise ValueError(f"level must be one of {list(SLEEP_LEVELS)} (vLLM's level 0, "
                             f"pausing the scheduler only, is not supported), got {level!r}")
        self._sleeping = True
        try:
            if mode == "abort":
                self.abort_all()
            while any(await self._on_every_replica("has_unfinished_requests")):
                await asyncio.sleep(0.01)
            await self._on_every_replica("sleep", level)
        except BaseException:
            self._sleeping = any(await self._on_every_replica("is_sleeping"))
            raise

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """-> whether the engine is fully awake (every tag back)."""
        await self._on_every_replica("wake_up", tags)
        self._sleeping = any(await self._on_every_replica("is_sleeping"))
        return not self._sleeping

    async def is_sleeping(self) -> bool:
        return self._sleeping

    def shutdown(self) -> None:
        self._stopped = True
        for loop in self.loops:
            loop.stop()
        for loop in self.loops:
            loop.join(timeout=30)
        for engine in self.engines:
            engine.shutdown()  # with several processes: the followers stop
        self._input_thread.shutdown(wait=False, cancel_futures=True)
        gone = EngineDeadError("the engine has been shut down")
        for stream in list(self._live):  # no output will ever come: end them
            stream.put(gone)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError("the engine loop has died") from self.dead_error
        if self._stopped:
            raise EngineDeadError("the engine has been shut down")

    def _died(self, error: BaseException) -> None:
        """On the dying engine thread: the whole front end is dead, every replica with it."""
        if self.dead_error is None:
            self.dead_error = error
        dead = EngineDeadError(f"the engine loop died: {type(error).__name__}: {error}")
        dead.__cause__ = error
        for stream in list(self._live):
            stream.put(dead)
        for loop in self.loops:
            loop.stop()


AsyncLLMEngine = AsyncLLM
