"""The OpenAI server's app for a pooling model: /v1/embeddings (OpenAI's) and vLLM's /pooling,
/classify, /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank, the Jina/Cohere shape),
beside /v1/models, /health and /version.

Owns the request bodies, their mapping onto PoolingEngine (jaxllm/pooling/offline.py, the
same calls `LLM.embed/classify/score/encode` make, so a response holds exactly the offline
rows) and the response shapes. Every bad input is a 400 with OpenAI's error JSON (an empty
input list, a prompt over max_model_len without truncate_prompt_tokens, `dimensions` on a
model without matryoshka support), an unknown model a 404. The engine runs on one thread of
its own (jaxllm/pooling/batching.py), which pools the prompts of concurrent requests in
shared steps. Never touches the device itself.
"""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import FastAPI, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict

import jaxllm
from jaxllm.entrypoints.openai.api_server import (APIError, InternalErrors, add_api_key_check,
                                                  error_response)
from jaxllm.pooling import offline
from jaxllm.pooling.batching import PoolingBatcher
from jaxllm.pooling.engine import PoolingEngine
from jaxllm.pooling.params import PoolingParams

Input = str | list[str] | list[int] | list[list[int]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    truncate_prompt_tokens: int | None = None


class EmbeddingRequest(_Body):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    user: str | None = None


class PoolingRequest(_Body):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    task: str | None = None  # None: the engine's pooling task (pooler_config's)


class ClassificationRequest(_Body):
    input: Input
    use_activation: bool | None = None


class ScoreRequest(_Body):
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None


class RerankRequest(_Body):
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True


def _inputs(value):
    if isinstance(value, list) and not value:
        raise ValueError("input must not be an empty list")
    if isinstance(value, str) and not value:
        raise ValueError("input must not be an empty string")
    return value


def _encode(row: np.ndarray, encoding_format: str):
    if encoding_format == "base64":  # float32 little-endian, what the openai client decodes
        return base64.b64encode(row.astype("<f4").tobytes()).decode()
    return row.tolist()


def _usage(outputs) -> dict:
    n = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


def build_pooling_app(engine: PoolingEngine, *, served_model_names: list[str],
                      api_key: str | list[str] | None = None) -> FastAPI:
    """api_key: one key or several; routes under /v1 then need one (as the generative app)."""
    batcher = PoolingBatcher(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()

    app = FastAPI(title="jaxllm", version=jaxllm.__version__, lifespan=lifespan)
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    labels = engine.labels

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"{first.get('msg', 'invalid request')}"
                              + (f" ({param})" if param else ""), "BadRequestError", param)

    @app.exception_handler(ValueError)
    async def _bad_value(request, exc: ValueError):
        return error_response(400, str(exc), "BadRequestError")

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    add_api_key_check(app, api_keys)
    app.add_middleware(InternalErrors)  # added last: the outermost

    def model_name(requested: str | None) -> str:
        if requested is None:
            return served_model_names[0]
        if requested not in served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist.", "NotFoundError",
                           "model")
        return requested

    async def pool(inputs, params: PoolingParams, task: str):
        return await batcher.encode(*offline.pooling_inputs(inputs, params), task)

    def envelope(prefix: str, model: str, data: list, outputs) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": model, "data": data,
                "usage": _usage(outputs)}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        model = model_name(body.model)
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                               truncate_prompt_tokens=body.truncate_prompt_tokens)
        outs = await pool(_inputs(body.input), params, "embed")
        data = [{"index": i, "object": "embedding",
                 "embedding": _encode(o.outputs.data, body.encoding_format)}
                for i, o in enumerate(outs)]
        return envelope("embd", model, data, outs)

    @app.post("/pooling")
    async def pooling(body: PoolingRequest):
        model = model_name(body.model)
        params = PoolingParams(dimensions=body.dimensions,
                               truncate_prompt_tokens=body.truncate_prompt_tokens)
        outs = await pool(_inputs(body.input), params,
                          body.task or engine.pooler_config.pooling_task)
        data = [{"index": i, "object": "pooling",
                 "data": _encode(o.outputs.data, body.encoding_format)}
                for i, o in enumerate(outs)]
        return envelope("pool", model, data, outs)

    @app.post("/classify")
    async def classify(body: ClassificationRequest):
        model = model_name(body.model)
        params = PoolingParams(use_activation=body.use_activation,
                               truncate_prompt_tokens=body.truncate_prompt_tokens)
        outs = await pool(_inputs(body.input), params, "classify")
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data
            best = int(np.argmax(probs))
            data.append({"index": i, "label": labels.get(best, str(best)),
                         "probs": probs.tolist(), "num_classes": int(probs.size)})
        return envelope("classify", model, data, outs)

    async def scores(text_1, text_2, truncate: int | None):
        plan = offline.plan_score(engine, text_1, text_2,
                                  PoolingParams(truncate_prompt_tokens=truncate))
        return plan.scores(await batcher.encode(plan.prompts, plan.params, plan.task))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest):
        model = model_name(body.model)
        one = body.text_1 if body.text_1 is not None else body.queries
        two = body.text_2 if body.text_2 is not None else body.documents
        if one is None or two is None:
            raise ValueError("score needs text_1 and text_2 (or queries and documents)")
        outs = await scores(one, two, body.truncate_prompt_tokens)
        data = [{"index": i, "object": "score", "score": o.outputs.score}
                for i, o in enumerate(outs)]
        return envelope("score", model, data, outs)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest):
        model = model_name(body.model)
        if not body.documents:
            raise ValueError("documents must not be an empty list")
        if body.top_n is not None and body.top_n < 0:
            raise ValueError(f"top_n must be >= 0, got {body.top_n}")
        outs = await scores(body.query, body.documents, body.truncate_prompt_tokens)
        order = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)
        top = order[:body.top_n] if body.top_n else order
        results = [{"index": i, "relevance_score": outs[i].outputs.score,
                    **({"document": {"text": body.documents[i]}}
                       if body.return_documents else {})} for i in top]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model,
                "usage": {"total_tokens": _usage(outs)["total_tokens"]}, "results": results}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "jaxllm",
             "root": engine.resolved_model.name, "parent": None,
             "max_model_len": engine.config.max_model_len} for name in served_model_names]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxllm.__version__}

    return app


__all__ = ["build_pooling_app"]
