"""Engine streams as responses read them: the last output, several interleaved, and an SSE body.

Owns the SSE framing (`data: {json}` events, a failure after the headers as an error event,
then always `data: [DONE]`), interleaving the streams of several prompts, and closing them:
a stream that ends, fails or is closed by a client that left closes (and so aborts) every
engine request it read. Never builds a chunk's content (serving_*.py do).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from jaxllm.async_llm import RequestStream
from jaxllm.entrypoints.openai.errors import raise_if_failed, sse_error
from jaxllm.outputs import RequestOutput


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


async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
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
