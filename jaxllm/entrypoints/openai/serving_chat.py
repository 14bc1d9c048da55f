"""/v1/chat/completions: a ChatCompletionRequest -> one engine stream -> OpenAI's chat bodies.

Owns the order of a chat's work (checks that need no rendering, the conversation rendered
by the server's template or the request's own in the sandbox, tokenized as the body asks,
admitted, then one response or a stream) and what a chat response holds beyond its text,
by vLLM's rules:
  - the reply's role: "assistant", or the last message's when add_generation_prompt is off;
  - echo: the last message's content before the reply's, when their roles match (so with
    continue_final_message, the message being continued);
  - return_token_ids (the prompt's ids on the response, or a stream's first chunks; each
    choice's `token_ids`), prompt_logprobs, return_prompt_text, return_tokens_as_token_ids;
  - usage (continuous_usage_stats: on every chunk, the counts so far).
How outputs read back as tool calls is tool_calls.py's and auto_tool_calls.py's. Never
touches HTTP, never renders or tokenizes on the event loop.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator

from jaxllm.engine.chat_messages import chat_messages
from jaxllm.engine.processor import PromptInput
from jaxllm.entrypoints.openai.auto_tool_calls import (AutoToolCallReader,
                                                       auto_stream_choices, auto_tool_message)
from jaxllm.entrypoints.openai.beam_serving import beam_chat
from jaxllm.entrypoints.openai.errors import raise_if_failed
from jaxllm.entrypoints.openai.logprobs_format import chat_logprobs, prompt_logprobs_json
from jaxllm.entrypoints.openai.prompt_tokens import check_truncation, tokenized
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.streams import coalesced, last_output, sse_body
from jaxllm.entrypoints.openai.structured_request import (RequestConstraint, chat_constraint,
                                                          errors_named)
from jaxllm.entrypoints.openai.tokenization import request_template
from jaxllm.entrypoints.openai.tool_calls import (stream_choices, tool_choice_message,
                                                  tool_reader)
from jaxllm.entrypoints.openai.usage import stream_usage, usage
from jaxllm.value_ranges import INT32_MAX, Range


def check_chat(serving, req: ChatCompletionRequest) -> tuple[str | None, RequestConstraint]:
    """-> (the request's own chat template (None: the server's), its constraint);
    ValueError for what can be told without rendering."""
    constraint = chat_constraint(req, serving.enable_auto_tools)
    serving.engine.engine.processor.check_priority(req.priority)
    check_truncation(req.truncate_prompt_tokens, serving.max_model_len)
    return request_template(serving, req), constraint


def max_tokens_param(req: ChatCompletionRequest) -> str | None:
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


def template_kwargs(req) -> dict:
    """The template's variables: the request's, then vLLM's own (documents, and
    reasoning_effort with enable_thinking) unless the request set them. req: a chat
    completion's body, or /tokenize's (which has neither)."""
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
              if k != "chat_template"}
    documents, effort = getattr(req, "documents", None), getattr(req, "reasoning_effort", None)
    if documents is not None:
        kwargs.setdefault("documents", documents)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


async def render(serving, req, template: str | None) -> PromptInput:
    """The conversation rendered by the server's template, or the request's own in the
    sandbox, and tokenized without special tokens, off the event loop. The request's tools
    are rendered whatever its tool_choice ("none" included, as vLLM)."""
    engine = serving.engine
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    kwargs = template_kwargs(req)
    if template is None:
        return await engine.render_chat(req.messages, serving.chat_template,
                                        req.add_generation_prompt,
                                        req.continue_final_message, kwargs, tools)
    messages = await engine.offload(chat_messages, req.messages)
    text = await serving.template_sandbox.render(
        template, messages, special_tokens=engine.tokenizer.special_tokens_map,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template_kwargs=kwargs,
        tools=tools)
    return await engine.offload(engine.engine.processor.chat_prompt, text)


async def chat_prompt(serving, req: ChatCompletionRequest, template: str | None
                      ) -> PromptInput:
    """The rendered conversation tokenized as the body asks (add_special_tokens,
    truncate_prompt_tokens, truncation_side), off the event loop."""
    engine = serving.engine
    prompt = await render(serving, req, template)
    if req.add_special_tokens:  # on top of what the template holds (vLLM's option)
        prompt = PromptInput(prompt.text, None)
    if req.add_special_tokens or req.truncate_prompt_tokens is not None:
        prompt = await engine.offload(functools.partial(
            tokenized, engine.engine.processor, prompt, add_special_tokens=True,
            truncate=req.truncate_prompt_tokens, side=req.truncation_side, with_text=False))
    return prompt


def tool_call_reading(serving, req: ChatCompletionRequest, constraint: RequestConstraint):
    """How a request's outputs read back as tool calls: None (as plain text), or (a new
    reader for one output, whole output -> (message, finish_reason), streamed delta ->
    the chunks' choices). A named or "required" choice reads its constrained JSON; "auto"
    has the --tool-call-parser read free text, each reader with its own parser."""
    if constraint.makes_tool_calls:
        return (lambda: tool_reader(constraint.tool_choice, constraint.tool_name),
                tool_choice_message, stream_choices)
    if constraint.tool_choice == "auto":
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        return (lambda: AutoToolCallReader(serving.tool_parser_cls(tools)),
                auto_tool_message, auto_stream_choices)
    return None


def reply_role(req: ChatCompletionRequest) -> str:
    return "assistant" if req.add_generation_prompt else req.messages[-1].get("role")


def echoed(req: ChatCompletionRequest, role: str) -> str:
    """What echo puts before the reply: the last message's content if it has the reply's
    role (its text parts joined, as the template read them)."""
    if not req.echo or not req.messages or req.messages[-1].get("role") != role:
        return ""
    content = req.messages[-1].get("content") or ""
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content)
    return content


async def create_chat_completion(serving, req: ChatCompletionRequest, model: str):
    template, constraint = check_chat(serving, req)
    param = max_tokens_param(req)
    prompt = await chat_prompt(serving, req, template)
    fits = None
    if param is not None:
        max_tokens = getattr(req, param)
        fits = functools.partial(serving.check_fits_context, param=param)
    else:  # vLLM: the rest of the context
        max_tokens = max(1, serving.max_model_len - len(prompt.token_ids))
    rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.use_beam_search:  # before any SamplingParams: n beams at temperature 0 are fine
        return await beam_chat(serving, req, prompt, max_tokens, rid, created, model,
                               reply_role(req))
    k = req.top_logprobs or 0
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs:
        prompt_logprobs = k  # vLLM: echo asks for the prompt's logprobs too
    params = req.sampling_params(max_tokens, k if req.logprobs else None, constraint.params,
                                 prompt_logprobs)
    with errors_named(constraint):
        stream, = await serving.engine.add_requests([prompt], params, [rid], req.priority,
                                                    check=fits,
                                                    lora_request=serving.lora_request(model))
    as_ids = serving.as_token_ids(req)
    if req.stream:
        return sse_body(_stream_chat(serving, stream, rid, created, model, req, k, as_ids,
                                     constraint))
    try:
        out = await last_output(stream)
    finally:
        stream.close()
    reading = tool_call_reading(serving, req, constraint)
    role, prefix = reply_role(req), echoed(req, reply_role(req))
    choices = []
    for c in out.outputs:
        message, finish = {"role": role, "content": prefix + c.text}, c.finish_reason
        if reading is not None:
            new_reader, message_of, _ = reading
            message, finish = message_of(new_reader(), c.text, finish)
        choice = {"index": c.index, "message": message,
                  "logprobs": (chat_logprobs(c.token_ids, c.logprobs, k, as_ids,
                                             serving.engine.tokenizer.decode)
                               if c.logprobs is not None else None),
                  "finish_reason": finish, "stop_reason": c.stop_reason,
                  # null unless asked for: vLLM's response states every field it has
                  "token_ids": list(c.token_ids) if req.return_token_ids else None}
        choices.append(choice)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices,
            "usage": serving.usage(len(out.prompt_token_ids),
                                   sum(len(c.token_ids) for c in out.outputs),
                                   out.num_cached_tokens),
            "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
            "prompt_token_ids": list(out.prompt_token_ids) if req.return_token_ids else None}
    if req.return_prompt_text:
        body["prompt_text"] = prompt.text
    return body


async def _stream_chat(serving, stream, rid, created, model, req, k, as_ids, constraint
                       ) -> AsyncIterator[dict]:
    readers, reading = None, tool_call_reading(serving, req, constraint)
    if reading is not None:
        new_reader, _, choices_of = reading
        readers = {i: new_reader() for i in range(req.n)}
    include, continuous = stream_usage(req.stream_options)
    num_prompt_tokens, num_tokens = 0, {i: 0 for i in range(req.n)}

    def chunk(choices, index=None, use=None, **extra):
        """A chunk; with continuous_usage_stats, the counts so far of choice `index`."""
        if continuous and use is None:
            use = usage(num_prompt_tokens, num_tokens[index] if index is not None else 0)
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": choices, "usage": use, **extra}

    role = reply_role(req)
    prefix = echoed(req, role)
    async with contextlib.aclosing(stream):  # a client that leaves aborts the request
        num_cached_tokens = 0
        async for out in coalesced(stream, req.stream_interval):
            raise_if_failed(out)
            if not num_prompt_tokens:
                num_prompt_tokens = len(out.prompt_token_ids)
                first = {}
                if req.return_token_ids:
                    first["prompt_token_ids"] = list(out.prompt_token_ids)
                if req.return_prompt_text:
                    first["prompt_text"] = out.prompt
                for i in range(req.n):
                    yield chunk([{"index": i, "delta": {"role": role, "content": ""},
                                  "logprobs": None, "finish_reason": None}], **first)
                for i in range(req.n if prefix else 0):
                    yield chunk([{"index": i, "delta": {"content": prefix},
                                  "logprobs": None, "finish_reason": None}])
            for c in out.outputs:
                num_tokens[c.index] += len(c.token_ids)
                logprobs = (chat_logprobs(c.token_ids, c.logprobs, k, as_ids,
                                             serving.engine.tokenizer.decode)
                            if c.logprobs is not None else None)
                if readers is not None:
                    if c.text or c.finish_reason is not None or logprobs is not None:
                        for choice in choices_of(readers[c.index], c, logprobs):
                            yield chunk([choice], c.index)
                    continue
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue  # nothing new
                choice = {"index": c.index, "delta": {"content": c.text},
                          "logprobs": logprobs, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                yield chunk([choice], c.index)
            if out.finished:
                num_cached_tokens = out.num_cached_tokens
    if include:
        yield chunk([], use=serving.usage(num_prompt_tokens, sum(num_tokens.values()),
                                          num_cached_tokens))
