"""/v1/completions: a CompletionRequest -> engine streams -> OpenAI's completion bodies.

Owns the order of a completion's work (checks that need no tokenizer, the prompts tokenized
as the body asks on the input thread, admission of every prompt at once, then one response
or a stream), choice indices across prompts and `n`, and usage (stream_options:
include_usage at the end, continuous_usage_stats on every chunk). What a choice holds
(echo, token ids, logprobs) is completion_choices.py's; beam search is beam_serving.py's.
Never touches HTTP and never tokenizes on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator

from jaxllm.engine.processor import PromptInput
from jaxllm.entrypoints.openai.beam_serving import beam_completion
from jaxllm.entrypoints.openai.completion_choices import (CompletionShape, StreamedChoices,
                                                          whole_choice)
from jaxllm.entrypoints.openai.errors import raise_if_failed
from jaxllm.entrypoints.openai.prompt_tokens import check_truncation, tokenized
from jaxllm.entrypoints.openai.protocol import CompletionRequest
from jaxllm.entrypoints.openai.streams import (coalesced, last_output, merge_streams,
                                               sse_body)
from jaxllm.entrypoints.openai.structured_request import completion_constraint, errors_named
from jaxllm.entrypoints.openai.usage import stream_usage, usage


def completion_prompts(req: CompletionRequest, max_prompts: int) -> list[PromptInput]:
    p = req.prompt
    if isinstance(p, str):
        return [PromptInput(p, None)]
    if p and all(isinstance(t, int) for t in p):
        return [PromptInput(None, list(p))]
    if not p:
        raise ValueError("prompt must not be empty")
    if len(p) > max_prompts:
        raise ValueError(f"prompt holds {len(p)} prompts; a request may hold at most "
                         f"{max_prompts} (--max-completion-prompts)")
    return [PromptInput(x, None) if isinstance(x, str) else PromptInput(None, list(x))
            for x in p]


def check_completion(serving, req: CompletionRequest):
    """-> (prompts, sampling params, constraint, shape); ValueError for what can be told
    without tokenizing (the rest is checked when the engine admits them)."""
    if req.best_of is not None and req.best_of != req.n:
        raise ValueError(f"best_of must equal n ({req.n}), got {req.best_of}")
    serving.engine.engine.processor.check_priority(req.priority)
    check_truncation(req.truncate_prompt_tokens, serving.max_model_len)
    constraint = completion_constraint(req)
    shape = CompletionShape.of(req, serving.return_tokens_as_token_ids)
    # echo with max_tokens 0 returns the prompt alone: the engine still makes one token
    max_tokens = 1 if shape.echo_only else req.max_tokens
    params = None if req.use_beam_search else req.sampling_params(
        max_tokens, req.logprobs, constraint.params, shape.prompt_logprobs(req))
    return (completion_prompts(req, serving.max_completion_prompts), params, constraint,
            shape)


async def create_completion(serving, req: CompletionRequest, model: str):
    prompts, params, constraint, shape = check_completion(serving, req)
    engine = serving.engine
    rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    processor = engine.engine.processor
    prepare = functools.partial(tokenized, processor, add_special_tokens=req.add_special_tokens,
                                truncate=req.truncate_prompt_tokens, side=req.truncation_side,
                                with_text=shape.echo)
    if (req.truncate_prompt_tokens is not None or not req.add_special_tokens or shape.echo
            or req.use_beam_search):  # beam search starts from token ids
        prompts = await engine.offload(lambda: [prepare(p) for p in prompts])
    if req.use_beam_search:
        return await beam_completion(serving, req, prompts, rid, created, model)
    # Every prompt is checked, its room in the context too, before any is queued.
    with errors_named(constraint):
        streams = await engine.add_requests(
            prompts, params, [f"{rid}-{i}" for i in range(len(prompts))], req.priority,
            check=functools.partial(serving.check_fits_context, param="max_tokens"),
            lora_request=serving.lora_request(model))
    decode = engine.tokenizer.decode
    if req.stream:
        return sse_body(_stream(serving, streams, prompts, rid, created, model, req, shape,
                                decode))
    try:
        finals = await asyncio.gather(*[last_output(s) for s in streams])
    finally:
        for s in streams:
            s.close()
    choices = [whole_choice(shape, i * req.n + c.index, out, c, prompts[i].text, decode)
               for i, out in enumerate(finals) for c in out.outputs]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices,
            "usage": serving.usage(sum(len(o.prompt_token_ids) for o in finals),
                                   sum(len(c.token_ids) for o in finals for c in o.outputs),
                                   sum(o.num_cached_tokens for o in finals))}


async def _stream(serving, streams, prompts, rid, created, model, req, shape, decode
                  ) -> AsyncIterator[dict]:
    include, continuous = stream_usage(req.stream_options)
    state = StreamedChoices(shape, decode)
    num_prompt_tokens: dict[int, int] = {}
    num_cached_tokens = 0
    async for i, out in merge_streams([coalesced(s, req.stream_interval) for s in streams],
                                      streams):
        raise_if_failed(out)
        num_prompt_tokens[i] = len(out.prompt_token_ids)
        for c in out.outputs:
            index = i * req.n + c.index
            choice = state.chunk_choice(index, out, c, prompts[i].text)
            if choice is None:
                continue
            chunk = {"id": rid, "object": "text_completion", "created": created,
                     "model": model, "choices": [choice], "usage": None}
            if continuous:
                chunk["usage"] = usage(num_prompt_tokens[i], state.num_tokens[index])
            yield chunk
        if out.finished:
            num_cached_tokens += out.num_cached_tokens
    if include:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [], "usage": serving.usage(sum(num_prompt_tokens.values()),
                                                     sum(state.num_tokens.values()),
                                                     num_cached_tokens)}
