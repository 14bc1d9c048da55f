"""Failures after admission, as OpenAI clients see them.

Owns what a request that already reached the engine turns into when it fails: a request the
engine finished with finish_reason "error" is a `GenerationError` (500, vLLM's), a dead or
stopped engine is a 503, a ValueError a 400, anything else a 500 whose details stay in the
log. A non-streaming response carries the error as its JSON body (api_server.py maps the
exception); a stream whose headers are already sent ends with the same body as an SSE event,
`data: {"error": {...}}`, then `data: [DONE]` (vLLM's shape). Never touches the engine.
"""

from __future__ import annotations

import json
import logging

from jaxllm.async_llm import EngineDeadError
from jaxllm.entrypoints.openai.protocol import error_body
from jaxllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """The engine failed this request (finish_reason "error"); it was stopped and its
    resources freed."""

    def __init__(self, request_id: str):
        super().__init__(f"Internal server error: the engine failed while generating request "
                         f"{request_id!r}; it was stopped")


def raise_if_failed(out: RequestOutput) -> None:
    if any(c.finish_reason == "error" for c in out.outputs):
        raise GenerationError(out.request_id)


def failure_body(error: Exception) -> dict:
    """OpenAI's error body for a failure after admission."""
    if isinstance(error, ValueError):
        return error_body(400, str(error), "BadRequestError")
    if isinstance(error, EngineDeadError):
        return error_body(503, str(error), "ServiceUnavailableError")
    if isinstance(error, GenerationError):
        return error_body(500, str(error), "InternalServerError")
    logger.error("a stream failed", exc_info=error)
    return error_body(500, "Internal server error", "InternalServerError")


def sse_error(error: Exception) -> str:
    """The event that ends a failed stream (before its `data: [DONE]`)."""
    return f"data: {json.dumps(failure_body(error))}\n\n"
