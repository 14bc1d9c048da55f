"""Completions and chat completions: OpenAI request bodies -> engine streams -> OpenAI bodies.

Owns the response shapes (non-streaming JSON, and SSE chunks ending in `data: [DONE]`), the
choice indices of `n` and of several prompts, usage counts, both logprobs formats, the cap
on prompts per request, and which chat template renders a conversation (with the request's
tools): the server's own, or one the request brings (refused unless the server trusts them,
and then rendered in a bounded sandbox process, template_sandbox.py). What a request
constrains its output to is structured_request.py's; how a named or "required" tool_choice
output reads back as tool calls, whole or streamed, is tool_calls.py's, and how an "auto"
one is read by the --tool-call-parser, auto_tool_calls.py's. Validates only what
is the server's own: a chat's max_tokens named as the client sent it (max_completion_tokens
or max_tokens), and vLLM's server rule that the prompt plus max_tokens must fit the context;
every other range is SamplingParams' and the processor's (their ValueError is a 400). Never
touches HTTP (api_server.py does), never tokenizes or renders on the event loop (AsyncLLM's
input thread does), and never runs the engine loop.

Every request is admitted (tokenized, checked, its ids reserved) before a response starts,
so bad input is a 400 even for a stream. After that a stream always ends with
`data: [DONE]`, after an error event (errors.py) if its request failed or the engine died.

Every request asks the engine for DELTA outputs when streaming and FINAL_ONLY otherwise, so
the stream's chunks concatenate to exactly the non-streaming result.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator

from jaxllm.async_llm import AsyncLLM, RequestStream
from jaxllm.engine.chat_messages import chat_messages
from jaxllm.engine.processor import ProcessedRequest, PromptInput
from jaxllm.entrypoints.openai.auto_tool_calls import (AutoToolCallReader,
                                                       auto_stream_choices, auto_tool_message)
from jaxllm.entrypoints.openai.errors import raise_if_failed, sse_error
from jaxllm.entrypoints.openai.logprobs_format import chat_logprobs, completion_logprobs
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxllm.entrypoints.openai.structured_request import (RequestConstraint, chat_constraint,
                                                          completion_constraint, errors_named)
from jaxllm.entrypoints.openai.tool_calls import (stream_choices, tool_choice_message,
                                                  tool_reader)
from jaxllm.entrypoints.openai.template_sandbox import TemplateSandbox
from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager
from jaxllm.outputs import RequestOutput
from jaxllm.value_ranges import INT32_MAX, ParameterError, Range

# vLLM's VLLM_MAX_COMPLETION_PROMPTS default: prompts in one /v1/completions request.
DEFAULT_MAX_COMPLETION_PROMPTS = 1024


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_names: list[str], chat_template: str | None,
                 *, trust_request_chat_template: bool = False,
                 max_completion_prompts: int = DEFAULT_MAX_COMPLETION_PROMPTS,
                 enable_auto_tools: bool = False, tool_parser: str | None = None):
        """trust_request_chat_template: accept a `chat_template` in chat requests (vLLM's
        --trust-request-chat-template); max_completion_prompts: the most prompts one
        /v1/completions request may hold; enable_auto_tools, tool_parser: vLLM's
        --enable-auto-tool-choice and --tool-call-parser (tool_choice="auto")."""
        if enable_auto_tools and tool_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser = tool_parser
        # An unknown name is refused at start-up, not at the first "auto" request.
        self.tool_parser_cls = (ToolParserManager.get_tool_parser(tool_parser)
                                if tool_parser is not None else None)
        self.engine = engine
        self.model_names = model_names
        self.chat_template = chat_template
        self.max_model_len = engine.engine.config.max_model_len
        self.max_completion_prompts = max_completion_prompts
        processor = engine.engine.processor
        # Request templates render in their own bounded process; nothing they build may
        # exceed what a prompt can be.
        self.template_sandbox = (TemplateSandbox(processor.max_prompt_chars)
                                 if trust_request_chat_template else None)

    def close(self) -> None:
        if self.template_sandbox is not None:
            self.template_sandbox.close()

    # ---- /v1/completions -----------------------------------------------------------------

    def completion_prompts(self, req: CompletionRequest) -> list[PromptInput]:
        p = req.prompt
        if isinstance(p, str):
            return [PromptInput(p, None)]
        if p and all(isinstance(t, int) for t in p):
            return [PromptInput(None, list(p))]
        if not p:
            raise ValueError("prompt must not be empty")
        if len(p) > self.max_completion_prompts:
            raise ValueError(f"prompt holds {len(p)} prompts; a request may hold at most "
                             f"{self.max_completion_prompts} (--max-completion-prompts)")
        return [PromptInput(x, None) if isinstance(x, str) else PromptInput(None, list(x))
                for x in p]

    def check_completion(self, req: CompletionRequest):
        """-> (prompts, sampling params); ValueError for what can be told without
        tokenizing (the rest is checked when the engine admits them)."""
        if req.echo:
            raise ValueError("echo is not supported")
        if req.suffix is not None:
            raise ValueError("suffix is not supported")
        if req.logit_bias:
            raise ValueError("logit_bias is not supported")
        if req.best_of is not None and req.best_of != req.n:
            raise ValueError(f"best_of must equal n ({req.n}), got {req.best_of}")
        self.engine.engine.processor.check_priority(req.priority)
        constraint = completion_constraint(req)
        params = req.sampling_params(req.max_tokens if req.max_tokens is not None else 16,
                                     req.logprobs, constraint.params)
        return self.completion_prompts(req), params, constraint

    async def create_completion(self, req: CompletionRequest, model: str):
        prompts, params, constraint = self.check_completion(req)
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        # Every prompt is tokenized and checked, its room in the context too, before any is
        # queued (on the input thread).
        with errors_named(constraint):
            streams = await self.engine.add_requests(
                prompts, params, [f"{rid}-{i}" for i in range(len(prompts))], req.priority,
                check=functools.partial(self.check_fits_context, param="max_tokens"))
        k = req.logprobs or 0
        if req.stream:
            return _sse_body(self._stream_completion(streams, rid, created, model, req, k))
        try:
            finals = await asyncio.gather(*[_last(s) for s in streams])
        finally:
            for s in streams:
                s.close()
        choices, completion_tokens = [], 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append({"index": i * params.n + c.index, "text": c.text,
                                "logprobs": completion_logprobs(c, k, 0),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    async def _stream_completion(self, streams, rid, created, model, req, k
                                 ) -> AsyncIterator[str]:
        prompt_tokens, completion_tokens = 0, 0
        offsets: dict[int, int] = {}
        async for i, out in _merge(streams):
            raise_if_failed(out)
            for c in out.outputs:
                index = i * req.n + c.index
                completion_tokens += len(c.token_ids)
                if not c.text and c.finish_reason is None and c.logprobs is None:
                    continue  # nothing visible yet (held back, or a partial character)
                chunk = {"index": index, "text": c.text,
                         "logprobs": completion_logprobs(c, k, offsets.get(index, 0)),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                offsets[index] = offsets.get(index, 0) + len(c.text)
                yield _sse({"id": rid, "object": "text_completion", "created": created,
                            "model": model, "choices": [chunk], "usage": None})
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
        if req.stream_options and req.stream_options.include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created,
                        "model": model, "choices": [],
                        "usage": _usage(prompt_tokens, completion_tokens)})

    # ---- /v1/chat/completions --------------------------------------------------------------

    def check_chat(self, req: ChatCompletionRequest) -> tuple[str | None, RequestConstraint]:
        """-> (the request's own chat template (None: the server's), its constraint);
        ValueError for what can be told without rendering."""
        if req.logit_bias:
            raise ValueError("logit_bias is not supported")
        constraint = chat_constraint(req, self.enable_auto_tools)
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        self.engine.engine.processor.check_priority(req.priority)
        template = req.chat_template
        if req.chat_template_kwargs and "chat_template" in req.chat_template_kwargs:
            template = req.chat_template_kwargs["chat_template"]
        if template is not None and self.template_sandbox is None:
            raise ValueError("this request brings its own chat_template, which the server "
                             "refuses: chat templates run as code, and request templates are "
                             "accepted only with --trust-request-chat-template")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"chat_template must be a string, got {type(template).__name__}")
        return template, constraint

    def chat_max_tokens_param(self, req: ChatCompletionRequest) -> str | None:
        """The field that sets this chat's max_tokens, its range checked and named as the
        client sent it: max_completion_tokens, else max_tokens; None when neither is given
        (the rest of the context). `is not None`, never `or`: max_completion_tokens=0 is
        refused (as vLLM does), not read as "not given"."""
        for param in ("max_completion_tokens", "max_tokens"):
            value = getattr(req, param)
            if value is not None:
                Range(1, INT32_MAX).check(param, value)
                return param
        return None

    async def chat_prompt(self, req: ChatCompletionRequest, template: str | None
                          ) -> PromptInput:
        """The conversation rendered and tokenized, off the event loop. The request's tools
        are rendered whatever its tool_choice ("none" included, as vLLM)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if template is None:
            return await self.engine.render_chat(
                req.messages, self.chat_template, req.add_generation_prompt,
                req.continue_final_message, req.chat_template_kwargs, tools)
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
                  if k != "chat_template"}
        messages = await self.engine.offload(chat_messages, req.messages)
        text = await self.template_sandbox.render(
            template, messages,
            special_tokens=self.engine.tokenizer.special_tokens_map,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template_kwargs=kwargs,
            tools=tools)
        return await self.engine.offload(self.engine.engine.processor.chat_prompt, text)

    def check_fits_context(self, request: ProcessedRequest, param: str) -> None:
        """vLLM's server refuses a request whose prompt plus max_tokens exceeds the context
        (offline, LLM.generate stops at max_model_len instead). Runs as add_requests' check:
        on the input thread, once the prompt is tokenized and before anything is queued."""
        prompt_len, max_tokens = len(request.prompt_token_ids), request.params.max_tokens
        room = self.max_model_len - prompt_len
        if max_tokens > room:
            raise ParameterError(f"{param}={max_tokens} does not fit: the prompt has "
                                 f"{prompt_len} tokens and the model's maximum context length "
                                 f"is {self.max_model_len}, so {param} must be at most {room}.",
                                 param)

    def tool_call_reading(self, req: ChatCompletionRequest, constraint: RequestConstraint):
        """How a request's outputs read back as tool calls: None (as plain text), or (a new
        reader for one output, whole output -> (message, finish_reason), streamed delta ->
        the chunks' choices). A named or "required" choice reads its constrained JSON; "auto"
        has the --tool-call-parser read free text, each reader with its own parser."""
        if constraint.makes_tool_calls:
            return (lambda: tool_reader(constraint.tool_choice, constraint.tool_name),
                    tool_choice_message, stream_choices)
        if constraint.tool_choice == "auto":
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            return (lambda: AutoToolCallReader(self.tool_parser_cls(tools)),
                    auto_tool_message, auto_stream_choices)
        return None

    async def create_chat_completion(self, req: ChatCompletionRequest, model: str):
        template, constraint = self.check_chat(req)
        param = self.chat_max_tokens_param(req)
        prompt = await self.chat_prompt(req, template)
        fits = None
        if param is not None:
            max_tokens = getattr(req, param)
            fits = functools.partial(self.check_fits_context, param=param)
        else:  # vLLM: the rest of the context
            max_tokens = max(1, self.max_model_len - len(prompt.token_ids))
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs
                                     else None, constraint.params)
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        with errors_named(constraint):
            stream, = await self.engine.add_requests([prompt], params, [rid], req.priority,
                                                     check=fits)
        k = req.top_logprobs or 0
        if req.stream:
            return _sse_body(self._stream_chat(stream, rid, created, model, req, k,
                                               constraint))
        try:
            out = await _last(stream)
        finally:
            stream.close()
        reading = self.tool_call_reading(req, constraint)
        choices = []
        for c in out.outputs:
            message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            if reading is not None:
                new_reader, message_of, _ = reading
                message, finish = message_of(new_reader(), c.text, finish)
            choices.append({"index": c.index, "message": message,
                            "logprobs": chat_logprobs(c, k), "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices,
                "usage": _usage(len(out.prompt_token_ids),
                                sum(len(c.token_ids) for c in out.outputs))}

    async def _stream_chat(self, stream, rid, created, model, req, k, constraint
                           ) -> AsyncIterator[str]:
        readers, reading = None, self.tool_call_reading(req, constraint)
        if reading is not None:
            new_reader, _, choices_of = reading
            readers = {i: new_reader() for i in range(req.n)}

        def chunk(choices, usage=None):
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": model, "choices": choices, "usage": usage})

        async with contextlib.aclosing(stream):  # a client that leaves aborts the request
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None} for i in range(req.n)])
            completion_tokens, prompt_tokens = 0, 0
            async for out in stream:
                raise_if_failed(out)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None and c.logprobs is None:
                        continue  # nothing visible yet (held back, or a partial character)
                    if readers is not None:
                        for choice in choices_of(readers[c.index], c, chat_logprobs(c, k)):
                            yield chunk([choice])
                        continue
                    yield chunk([{"index": c.index, "delta": {"content": c.text},
                                  "logprobs": chat_logprobs(c, k),
                                  "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason}])
                prompt_tokens = len(out.prompt_token_ids)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage(prompt_tokens, completion_tokens))


async def _sse_body(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's body: its chunks, then `data: [DONE]`, after an error event if it failed
    once its headers were sent. A client that leaves closes it (and its requests) instead."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except Exception as error:
        yield sse_error(error)
    yield "data: [DONE]\n\n"


async def _last(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        raise_if_failed(out)
    return out


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as they produce, tagged with their index; closing
    it (or a failure of any) closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # hand the error to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()
