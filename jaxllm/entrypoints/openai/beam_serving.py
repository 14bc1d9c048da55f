"""`use_beam_search` on both endpoints: jaxllm/beam_search.py's search, driven over AsyncLLM.

Owns vLLM's mapping of a body onto BeamSearchParams (beam_width = n; temperature, when not
given, 1.0 as vLLM's server defaults it; length_penalty, ignore_eos,
include_stop_str_in_output) and the responses: one choice per beam, best first. Each step's
one-token requests run as ordinary engine requests (their full blocks are shared through
the prefix cache); a client that leaves cancels the search, and garbage streams abort their
requests. Streaming is refused at parsing (request_rules.py), as vLLM refuses it.
Never scores a beam itself (beam_search.py does).
"""

from __future__ import annotations

import asyncio

from jaxllm.beam_search import BeamSearch, BeamSearchParams, request_outputs
from jaxllm.engine.processor import PromptInput
from jaxllm.entrypoints.openai.completion_choices import CompletionShape, whole_choice
from jaxllm.entrypoints.openai.logprobs_format import chat_logprobs
from jaxllm.entrypoints.openai.streams import last_output
from jaxllm.outputs import RequestOutput


def beam_params(req, max_tokens: int) -> BeamSearchParams:
    return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                            temperature=1.0 if req.temperature is None else req.temperature,
                            length_penalty=req.length_penalty,
                            include_stop_str_in_output=req.include_stop_str_in_output)


async def run_beam_search(serving, prompts: list[PromptInput], params: BeamSearchParams,
                          priority: int, lora_request=None) -> list[RequestOutput]:
    engine = serving.engine
    search = BeamSearch(engine.engine, params)
    instances = await engine.offload(search.start,
                                     [{"prompt_token_ids": p.token_ids} for p in prompts])
    for instance, prompt in zip(instances, prompts):
        instance.prompt = prompt.text
    for _ in range(params.max_tokens):
        beams = search.step_prompts(instances)
        if not beams:
            break
        streams = await engine.add_requests([PromptInput(None, b.tokens) for b in beams],
                                            search.step_params, None, priority,
                                            lora_request=lora_request)
        try:
            outputs = await asyncio.gather(*[last_output(s) for s in streams])
        finally:
            for s in streams:
                s.close()
        search.advance(instances, beams, outputs)
    return await engine.offload(request_outputs, search, instances)


async def beam_completion(serving, req, prompts, rid, created, model) -> dict:
    finals = await run_beam_search(serving, prompts, beam_params(req, req.max_tokens),
                                   req.priority, serving.lora_request(model))
    shape = CompletionShape.of(req, serving.return_tokens_as_token_ids)
    decode = serving.engine.tokenizer.decode
    choices = [whole_choice(shape, i * req.n + c.index, out, c, prompts[i].text, decode)
               for i, out in enumerate(finals) for c in out.outputs]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices,
            "usage": serving.usage(sum(len(o.prompt_token_ids) for o in finals),
                                   sum(len(c.token_ids) for o in finals for c in o.outputs))}


async def beam_chat(serving, req, prompt, max_tokens, rid, created, model, role) -> dict:
    out, = await run_beam_search(serving, [prompt], beam_params(req, max_tokens),
                                 req.priority, serving.lora_request(model))
    k, as_ids = req.top_logprobs or 0, serving.as_token_ids(req)
    choices = [{"index": c.index, "message": {"role": role, "content": c.text},
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, k, as_ids,
                                             serving.engine.tokenizer.decode)
                if req.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for c in out.outputs]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices,
            "usage": serving.usage(len(out.prompt_token_ids),
                                   sum(len(c.token_ids) for c in out.outputs))}
