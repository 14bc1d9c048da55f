"""The OpenAI-compatible HTTP server: a FastAPI app over one AsyncLLM.

Owns the routes (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/health, /version, /metrics; the optional ones of vLLM's flags are added by frontend.py),
API-key checks, the mapping of every failure to OpenAI's error
body with the right status (400 for bad input of any kind, never 422; 404 for an unknown
model; 401 for a missing or wrong key; 500 for a request the engine failed, and for any other
internal error, still as the error JSON and with the traceback logged; 503 when the engine is
gone), and aborting a request whose client went away. Never builds sampling parameters or
responses itself (serving.py does), and never tokenizes or detokenizes on the event loop
(AsyncLLM's input thread does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.async_llm import AsyncLLM, EngineDeadError, EngineSleepingError
from jaxllm.entrypoints.openai.errors import GenerationError
from jaxllm.entrypoints.openai.frontend import (FrontendOptions, check_prompt_embeds, install,
                                                load_tracker, model_card)
from jaxllm.entrypoints.openai.lora_routes import (install_lora_routes, lora_cards,
                                                   parse_lora_modules, register_lora_modules)
from jaxllm.entrypoints.openai.metrics import render_metrics
from jaxllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                DetokenizeRequest, TokenizeRequest, error_body)
from jaxllm.entrypoints.openai.serving import DEFAULT_MAX_COMPLETION_PROMPTS, OpenAIServing
from jaxllm.entrypoints.openai.tokenization import tokenize_response


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


logger = logging.getLogger(__name__)


def error_response(status: int, message: str, type_: str, param: str | None = None):
    return JSONResponse(status_code=status, content=error_body(status, message, type_, param))


def add_api_key_check(app: FastAPI, api_keys) -> None:
    """vLLM's --api-key: every /v1 route wants `Authorization: Bearer <one of the keys>`
    (compared in constant time), else a 401 with OpenAI's error JSON; none given, no check."""

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_keys and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "").encode()
            if not any([hmac.compare_digest(given, f"Bearer {key}".encode())
                        for key in api_keys]):
                return error_response(401, "Unauthorized: a valid API key is required",
                                      "authentication_error")
        return await call_next(request)


class InternalErrors:
    """The outermost middleware: an exception no handler answered becomes OpenAI's error JSON
    with a 500 (Starlette's last resort is a plain-text body) and its traceback is logged,
    once. A response already started (a stream) cannot be replaced, so the exception goes on
    to the server, which closes the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            logger.exception("internal error answering %s %s", scope.get("method"),
                             scope.get("path"))
            response = error_response(500, f"{type(exc).__name__}: {exc}",
                                      "InternalServerError")
            await response(scope, receive, send)


def build_app(engine: AsyncLLM, *, served_model_names: list[str], api_key: str | None = None,
              chat_template: str | None = None, trust_request_chat_template: bool = False,
              max_completion_prompts: int = DEFAULT_MAX_COMPLETION_PROMPTS,
              enable_auto_tools: bool = False, tool_parser: str | None = None,
              frontend: FrontendOptions | None = None,
              enable_prompt_tokens_details: bool = True,
              lora_modules: list[str] | None = None) -> FastAPI:
    """api_key: one key or several (any of them is accepted); frontend: the optional routes
    and middlewares of vLLM's flags (frontend.py; its return_tokens_as_token_ids is the
    serving's default); enable_prompt_tokens_details: usage states cached prompt tokens.
    lora_modules: --lora-modules (lora_routes.py); a request's `model` may name one."""
    frontend = frontend or FrontendOptions()
    register_lora_modules(engine, parse_lora_modules(lora_modules), served_model_names)
    loras = engine.engine.lora_manager
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    serving = OpenAIServing(engine, served_model_names, chat_template,
                            trust_request_chat_template=trust_request_chat_template,
                            max_completion_prompts=max_completion_prompts,
                            enable_auto_tools=enable_auto_tools, tool_parser=tool_parser,
                            enable_prompt_tokens_details=enable_prompt_tokens_details)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()  # graceful: uvicorn stops taking requests first
        serving.close()
        logging.getLogger("uvicorn.error").info("jaxllm: engine shut down")

    docs = dict(docs_url=None, redoc_url=None, openapi_url=None) if (
        frontend.disable_fastapi_docs) else {}
    app = FastAPI(title="jaxllm", version=jaxllm.__version__, lifespan=lifespan, **docs)
    app.state.serving = serving
    app.state.engine_client = engine  # vLLM's name; launcher.py stops the server if it dies

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"Invalid JSON body: {first.get('msg')}",
                                  "BadRequestError")
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "value_error":  # our own checks: their message as written
            error = first.get("ctx", {}).get("error", message)
            if getattr(error, "param", None):  # a ParameterError: it names its field
                return error_response(400, str(error), "BadRequestError", error.param)
            message = str(error)
        return error_response(400, message + (f" ({param})" if param else ""),
                              "BadRequestError", param)

    @app.exception_handler(ValueError)
    async def _bad_value(request, exc: ValueError):
        return error_response(400, str(exc), "BadRequestError", getattr(exc, "param", None))

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(EngineDeadError)
    async def _dead(request, exc: EngineDeadError):
        return error_response(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(EngineSleepingError)
    async def _sleeping(request, exc: EngineSleepingError):
        return error_response(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(GenerationError)
    async def _failed(request, exc: GenerationError):
        return error_response(500, str(exc), "InternalServerError")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "NotFoundError"
                              if exc.status_code == 404 else "BadRequestError")

    add_api_key_check(app, api_keys)
    app.add_middleware(InternalErrors)  # added last: the outermost, around the key check too

    def model_name(requested: str | None) -> str:
        if requested is None:
            return served_model_names[0]
        if requested not in served_model_names and loras.get_lora(requested) is None:
            raise APIError(404, f"The model `{requested}` does not exist.", "NotFoundError",
                           "model")
        return requested

    async def respond(result, request: Request):
        if isinstance(result, Response):  # the client left: nobody reads it
            return result
        if not isinstance(result, dict):  # a stream of SSE chunks
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result)

    track = load_tracker(app, frontend.enable_server_load_tracking)

    @app.post("/v1/completions")
    @track
    async def completions(body: CompletionRequest, request: Request):
        model = model_name(body.model)
        check_prompt_embeds(frontend, body.prompt_embeds)
        return await respond(await _until_disconnect(
            serving.create_completion(body, model), request), request)

    @app.post("/v1/chat/completions")
    @track
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = model_name(body.model)
        return await respond(await _until_disconnect(
            serving.create_chat_completion(body, model), request), request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name, engine, serving.max_model_len)
                                           for name in served_model_names]
                + lora_cards(engine, served_model_names[0])}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        model_name(body.model)
        return await tokenize_response(serving, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        model_name(body.model)
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"tokens must be in [0, {vocab}), got {bad[0]}")
        return {"prompt": await engine.offload(engine.tokenizer.decode, body.tokens)}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return error_response(503, "the engine is not running", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxllm.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(render_metrics(engine.get_metrics()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    install(app, frontend, engine=engine, serving=serving, model_name=model_name,
            completions=completions, chat_completions=chat_completions, api_error=APIError)
    install_lora_routes(app, engine, served_model_names, APIError)
    return app


async def _until_disconnect(coro, request: Request):
    """Run a handler, but cancel it (which aborts its engine requests) if the client leaves
    before it answers. Streams are covered by their own cancellation."""
    task = asyncio.ensure_future(coro)

    async def client_left():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(client_left())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
        return task.result()
    finally:
        watcher.cancel()
