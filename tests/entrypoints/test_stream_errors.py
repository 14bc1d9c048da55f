"""Every stream ends: `data: [DONE]`, after an error event in vLLM's shape when its request
failed once the headers were sent; and what can be refused before the headers is a 400.

The app runs in-process over the tiny model's AsyncLLM (httpx's ASGI transport buffers a
response whole, so each body is asserted exactly), with faults injected into the real engine:
an id already in flight, a failed admission, a failed model step, and a dead engine loop.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from jaxllm import AsyncEngineArgs, AsyncLLM
from jaxllm.entrypoints.openai.api_server import build_app

from engine_e2e.tiny_model import SMALL, build_tiny_llama_dir

ARGS = {k: v for k, v in SMALL.items() if k != "use_tqdm_on_load"}
MESSAGES = [{"role": "user", "content": "Hi"}]
DONE = "data: [DONE]"


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_stream_errors")))


@pytest.fixture(scope="module")
def engine(tiny_dir):
    engine = AsyncLLM(AsyncEngineArgs(model=tiny_dir, **ARGS))
    yield engine
    engine.shutdown()


def client(engine) -> httpx.AsyncClient:
    app = build_app(engine, served_model_names=["tiny"])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test",
                             timeout=300)


def events(response: httpx.Response) -> list[str]:
    return [e for e in response.text.split("\n\n") if e]


def error_event(status: int, type_: str, message: str) -> str:
    return "data: " + json.dumps({"error": {"message": message, "type": type_, "param": None,
                                            "code": status}})


def failed(request_id: str) -> str:
    return error_event(500, "InternalServerError", "Internal server error: the engine failed "
                                                   f"while generating request {request_id!r}; "
                                                   "it was stopped")


def assert_idle(engine):
    """Nothing left once the engine thread has applied the drops (it does so after the
    responses end)."""
    llm_engine = engine.engine
    asyncio.run(until(lambda: len(engine.request_ids) == 0
                      and not llm_engine.has_unfinished_requests()))
    stats = llm_engine.scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


async def until(condition, timeout=60.0):
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_stream_with_an_id_in_flight_is_refused_before_its_headers(engine):
    """The repro of issue 15's bug 4: it used to be a 200 with an empty chunked body."""
    body = {"messages": MESSAGES, "max_tokens": 150, "ignore_eos": True, "stream": True}

    async def main():
        async with client(engine) as c:
            first = asyncio.create_task(c.post("/v1/chat/completions",
                                               json={**body, "request_id": "0_x"}))
            await until(lambda: "0_x" in engine.request_ids)
            samples = await c.post("/v1/chat/completions", json={
                **body, "request_id": "x", "n": 2, "temperature": 1})
            same = await c.post("/v1/chat/completions", json={**body, "request_id": "0_x"})
            return await first, samples, same

    first, samples, same = asyncio.run(main())
    assert (samples.status_code, samples.json()) == (400, {"error": {
        "message": "request_id 'x' with n=2 runs its samples as '0_x', an id already in "
                   "flight: request ids, and the '<index>_<request_id>' ids of their n > 1 "
                   "samples, must be unique among unfinished requests",
        "type": "BadRequestError", "param": None, "code": 400}})
    assert (same.status_code, same.json()["error"]["message"]) == (
        400, "request_id '0_x' is already in flight: request ids must be unique among "
             "unfinished requests")
    chunks = events(first)
    assert first.status_code == 200 and chunks[-1] == DONE
    assert json.loads(chunks[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert_idle(engine)


def test_a_failed_admission_ends_the_stream_with_an_error_event(engine, monkeypatch):
    core = engine.engine.engine_core
    add = core.add_request

    def add_request(request):
        if request.request_id.endswith("-1"):  # a request's second prompt
            raise Injected("admit")
        add(request)

    monkeypatch.setattr(core, "add_request", add_request)
    body = {"prompt": ["Hello", "World"], "max_tokens": 4, "ignore_eos": True}

    async def main():
        async with client(engine) as c:
            return (await c.post("/v1/completions", json={**body, "stream": True,
                                                           "request_id": "adm"}),
                    await c.post("/v1/completions", json={**body, "request_id": "whole"}))

    streamed, whole = asyncio.run(main())
    # The first prompt may have streamed some text before the second one's failure arrived.
    chunks = events(streamed)
    assert streamed.status_code == 200 and chunks[-2:] == [failed("adm-1"), DONE]
    assert all(json.loads(e[6:])["choices"][0]["index"] == 0 for e in chunks[:-2])
    assert (whole.status_code, whole.json()) == (500, json.loads(failed("whole-1")[6:]))
    assert_idle(engine)


def test_a_failed_step_ends_the_stream_with_an_error_event(engine, monkeypatch):
    runner = engine.engine.runner
    dispatch = runner.dispatch
    carried = {"n": 0}

    def failing_dispatch(so):
        if "stepfail" in so.num_scheduled_tokens:
            carried["n"] += 1
            if carried["n"] == 4:  # its prefill and two decode steps ran
                raise Injected("execute")
        return dispatch(so)

    monkeypatch.setattr(runner, "dispatch", failing_dispatch)

    async def main():
        async with client(engine) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 50, "ignore_eos": True, "stream": True,
                "request_id": "stepfail"})

    response = asyncio.run(main())
    chunks = events(response)
    assert response.status_code == 200 and chunks[-2:] == [failed("stepfail"), DONE]
    first = json.loads(chunks[0][6:])
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
    assert len(chunks[1:-2]) <= 3  # text of the steps that ran (a partial character waits)
    assert all(json.loads(e[6:])["choices"][0]["finish_reason"] is None for e in chunks[1:-2])
    assert_idle(engine)


def test_engine_death_ends_every_stream_with_an_error_event(tiny_dir):
    engine = AsyncLLM(AsyncEngineArgs(model=tiny_dir, **ARGS))
    llm_engine = engine.engine
    step = llm_engine.step

    def dying_step():
        # Dies once all three requests are running: each has a stream in flight.
        if len(llm_engine.output_processor.parents) == 3 and llm_engine.scheduler.running:
            raise MemoryError("the loop itself broke")
        return step()

    llm_engine.step = dying_step
    body = {"prompt": "Go", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def main():
        async with client(engine) as c:
            streams = await asyncio.gather(*[c.post("/v1/completions", json=body)
                                             for _ in range(3)])
            return streams, await c.get("/health"), await c.post("/v1/completions",
                                                                 json=body)

    try:
        streams, health, later = asyncio.run(main())
    finally:
        engine.shutdown()
    dead = error_event(503, "ServiceUnavailableError",
                       "the engine loop died: MemoryError: the loop itself broke")
    for response in streams:
        assert response.status_code == 200 and events(response)[-2:] == [dead, DONE]
    assert health.status_code == 503
    assert (later.status_code, later.json()["error"]["message"]) == (
        503, "the engine loop has died")
