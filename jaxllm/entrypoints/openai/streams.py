"""Engine streams as responses read them: the last output, several interleaved, and an SSE body.

Owns the SSE framing (`data: {json}` events, a failure after the headers as an error event,
then always `data: [DONE]`), interleaving the streams of several prompts, a request's
`stream_interval` (vLLM's: a choice's deltas are held until they hold that many tokens; its
first and last go at once), and closing them:
a stream that ends, fails or is closed by a client that left closes (and so aborts) every
engine request it read. Never builds a chunk's content (serving_*.py do).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator

from jaxllm.async_llm import RequestStream
from jaxllm.entrypoints.openai.errors import raise_if_failed, sse_error
from jaxllm.outputs import CompletionOutput, RequestOutput


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def sse_body(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """A stream's body: its chunks, then `data: [DONE]`, after an error event if it failed
    once its headers were sent. A client that leaves closes it (and its requests) instead."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield sse(chunk)
    except Exception as error:
        yield sse_error(error)
    yield "data: [DONE]\n\n"


async def last_output(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        raise_if_failed(out)
    return out


async def merge_streams(outputs: list[AsyncIterator[RequestOutput]],
                        streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output iterators (each reading one of `streams`) as they produce,
    tagged with their index; closing it (or a failure of any) closes every stream."""
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

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(outputs)]
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


async def coalesced(stream, interval: int | None) -> AsyncIterator[RequestOutput]:
    """A DELTA stream whose choices each go out once they hold `interval` tokens, or
    finish; a choice's first delta goes at once. The caller closes `stream`."""
    if interval is None or interval <= 1:
        async for out in stream:
            yield out
        return
    sent: set[int] = set()
    pending: dict[int, CompletionOutput] = {}
    async for out in stream:
        ready = []
        for c in out.outputs:
            if c.index in pending:
                c = _joined(pending.pop(c.index), c)
            if c.index not in sent or c.finish_reason is not None or \
                    len(c.token_ids) >= interval:
                sent.add(c.index)
                ready.append(c)
            else:
                pending[c.index] = c
        if ready or out.finished:
            yield dataclasses.replace(out, outputs=ready)


def _joined(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    """Two consecutive deltas of one choice as one."""
    logprobs = None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs
    return dataclasses.replace(b, text=a.text + b.text, token_ids=[*a.token_ids, *b.token_ids],
                               logprobs=logprobs)
