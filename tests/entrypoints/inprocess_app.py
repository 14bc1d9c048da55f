"""The OpenAI server's app over a tiny AsyncLLM, called in-process through httpx's ASGI
transport: no socket and no subprocess, so a test can send thousands of bodies in seconds.

Owns the engine settings of these tests and the checks every test shares: the error body's
exact shape, and that the engine ends idle (nothing running or waiting, every KV block free).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from jaxllm import AsyncEngineArgs, AsyncLLM
from jaxllm.entrypoints.openai.api_server import build_app

MAX_MODEL_LEN = 64
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN,
              dtype="float32", enforce_eager=True)


class InProcessApp:
    def __init__(self, model_dir: str, engine_options: dict | None = None, **app_options):
        """engine_options: engine settings over ENGINE's (e.g. max_logprobs); app_options:
        build_app's server options (e.g. trust_request_chat_template)."""
        self.engine = AsyncLLM(AsyncEngineArgs(model=model_dir,
                                               **{**ENGINE, **(engine_options or {})}))
        self.app = build_app(self.engine, served_model_names=["tiny"], **app_options)

    def client(self) -> httpx.AsyncClient:
        # raise_app_exceptions=False: a client sees what a server would send, never the
        # app's exception itself.
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        return httpx.AsyncClient(transport=transport, base_url="http://jaxllm", timeout=300)

    def post(self, path: str, body) -> httpx.Response:
        async def one():
            async with self.client() as client:
                if isinstance(body, (bytes, str)):
                    return await client.post(path, content=body,
                                             headers={"content-type": "application/json"})
                return await client.post(path, json=body)

        return asyncio.run(one())

    def get(self, path: str) -> httpx.Response:
        async def one():
            async with self.client() as client:
                return await client.get(path)

        return asyncio.run(one())

    def assert_idle(self, timeout: float = 30.0) -> None:
        """Nothing running or waiting and every KV block free, once the engine thread has
        applied the last finish (it may trail the last response by a step)."""
        engine = self.engine.engine
        kv = engine.kv_cache_manager
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (not engine.has_unfinished_requests()
                    and kv.num_free_blocks == kv.num_blocks - 1):
                break
            time.sleep(0.05)
        assert not engine.has_unfinished_requests()
        assert kv.num_free_blocks == kv.num_blocks - 1
        assert self.engine.is_running

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.app.state.serving.close()  # the template sandbox's process, if one started


def error_of(response: httpx.Response, status: int) -> dict:
    """The response's OpenAI error, after checking its status and exact shape."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error
