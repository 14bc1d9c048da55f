"""The server's optional parts, each behind its vLLM flag: SageMaker's /invocations,
GET /v1/models/{id}, /tokenizer_info, /load (server load tracking), /sleep, /wake_up and
/is_sleeping (sleep mode), the X-Request-Id header, CORS, and the prompt-embeds rule.

Owns `FrontendOptions` (those flags, frozen) and `install`, which adds these routes and
middlewares to the app that api_server.py builds. Never builds a completion itself: the
/invocations route hands its body to the completions or chat route.

Prompt embeddings: vLLM's `prompt_embeds` is a base64 `torch.save` payload, a zip holding a
pickle. Unpickling runs whatever the pickle names; rebuilding the tensor without torch would
mean a hand-written restricted unpickler of torch's private storage format. jaxllm refuses
the payload instead, with a 400 that says why (and none of its code imports torch).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid

from fastapi import FastAPI, Query, Request
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.datastructures import Headers, MutableHeaders

from jaxllm.entrypoints.openai.lora_routes import lora_card
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

PROMPT_EMBEDS_REFUSED = (
    "prompt_embeds is not supported: vLLM's payload is a torch.save pickle, which jaxllm "
    "cannot decode safely without torch")
PROMPT_EMBEDS_NEEDS_FLAG = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."


@dataclasses.dataclass(frozen=True)
class FrontendOptions:
    enable_request_id_headers: bool = False
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_sleep_mode: bool = False
    # The default of the request field of the same name (vLLM's --return-tokens-as-token-ids),
    # read by serving as `OpenAIServing.return_tokens_as_token_ids`.
    return_tokens_as_token_ids: bool = False
    enable_prompt_embeds: bool = False
    allowed_origins: list[str] | None = None  # None: no CORS headers at all
    allowed_methods: list[str] | None = None
    allowed_headers: list[str] | None = None
    allow_credentials: bool = False
    disable_fastapi_docs: bool = False

    @classmethod
    def from_settings(cls, settings: dict) -> "FrontendOptions":
        return cls(**{f.name: settings[f.name] for f in dataclasses.fields(cls)})


def model_card(name: str, engine, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "jaxllm",
            "root": engine.engine.config.model, "max_model_len": max_model_len}


def check_prompt_embeds(options: FrontendOptions, prompt_embeds) -> None:
    """A completions request with `prompt_embeds`: vLLM's 400 without the flag, jaxllm's
    refusal with it."""
    if prompt_embeds is not None:
        raise ValueError(PROMPT_EMBEDS_REFUSED if options.enable_prompt_embeds
                         else PROMPT_EMBEDS_NEEDS_FLAG)


class RequestIdHeader:
    """X-Request-Id on every response: the request's own header, else a fresh uuid4 hex
    (vLLM's --enable-request-id-headers)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def with_id(message):
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message["headers"]).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, with_id)


def load_tracker(app: FastAPI, enabled: bool):
    """A decorator for the generating routes: with server load tracking, count a request
    from its arrival until its response (a stream included) has been sent. /load reads the
    count (vLLM's server_load_metrics)."""
    app.state.server_load_metrics = 0
    if not enabled:
        return lambda route: route

    def tracked(route):
        @functools.wraps(route)
        async def counted(*args, **kwargs):
            app.state.server_load_metrics += 1
            try:
                response = await route(*args, **kwargs)
            except BaseException:
                app.state.server_load_metrics -= 1
                raise
            done = BackgroundTask(_decrement, app)
            first = response.background
            response.background = done if first is None else BackgroundTask(_chain, first, done)
            return response
        return counted

    return tracked


def install(app: FastAPI, options: FrontendOptions, *, engine, serving, model_name,
            completions, chat_completions, api_error) -> None:
    """Add the optional routes and middlewares. model_name: the app's check of a request's
    `model` (404 for an unknown one); completions, chat_completions: the app's route
    functions; api_error(status, message, type, param): the app's error exception."""
    # The server default of the request field of the same name (serving reads it).
    serving.return_tokens_as_token_ids = options.return_tokens_as_token_ids

    @app.get("/load")
    async def load():
        return {"server_load": app.state.server_load_metrics}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        name = model_name(model_id)
        return (lora_card(engine, name, serving.model_names[0])  # an adapter's, with parent
                or model_card(name, engine, serving.max_model_len))

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker: the body's shape chooses the route, chat first (vLLM's order)."""
        body = await request.json()
        for kind, route in ((ChatCompletionRequest, chat_completions),
                            (CompletionRequest, completions)):
            try:
                parsed = kind.model_validate(body)
            except (ValidationError, ValueError):
                continue
            return await route(parsed, request)
        raise api_error(400, "Cannot find suitable handler for request. Expected one of: "
                             "['ChatCompletionRequest', 'CompletionRequest']",
                        "BadRequestError", None)

    if options.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return tokenizer_config(engine.tokenizer, serving.chat_template)

    if options.enable_sleep_mode:
        @app.post("/sleep")
        async def sleep(level: int = Query(1), mode: str = Query("abort")):
            await engine.sleep(level, mode)
            return {"status": "sleeping", "level": level}

        @app.post("/wake_up")
        async def wake_up(request: Request):
            tags = request.query_params.getlist("tags") or None
            awake = await engine.wake_up(tags)
            return {"status": "awake" if awake else "sleeping", "tags": tags}

        @app.get("/is_sleeping")
        async def is_sleeping():
            return {"is_sleeping": await engine.is_sleeping()}

    if options.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    if options.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                           allow_credentials=options.allow_credentials,
                           allow_methods=options.allowed_methods or ["*"],
                           allow_headers=options.allowed_headers or ["*"])


def tokenizer_config(tokenizer, chat_template: str | None) -> dict:
    """/tokenizer_info: the tokenizer's init arguments, JSON-safe, without file paths, and
    its class (vLLM's TokenizerInfo); an added token reads as its content, except in
    added_tokens_decoder, where each is its fields (content, special, ...)."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    decoder = config.pop("added_tokens_decoder", None)
    config = _json_safe(config)
    if decoder is not None:  # as tokenizer_config.json writes it: id -> the token's fields
        config["added_tokens_decoder"] = {
            str(i): t.__getstate__() if hasattr(t, "__getstate__") and hasattr(t, "content")
            else _json_safe(t) for i, t in decoder.items()}
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _json_safe(obj):
    if hasattr(obj, "content"):  # an AddedToken
        return obj.content
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def _decrement(app) -> None:
    app.state.server_load_metrics -= 1


async def _chain(first: BackgroundTask, then: BackgroundTask) -> None:
    try:
        await first()
    finally:
        await then()


__all__ = ["FrontendOptions", "PROMPT_EMBEDS_REFUSED", "check_prompt_embeds", "install",
           "load_tracker", "model_card", "tokenizer_config"]
