"""`jaxllm serve` for real, on the tiny random model: the openai client streaming and not,
httpx for raw SSE framing and the error cases, API keys, 256 concurrent streams, and a client
that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from engine_e2e.tiny_model import build_tiny_llama_dir

from remote_server import RemoteServer

ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "64", "--max-num-batched-tokens",
               "256", "--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_serve")))


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = RemoteServer([tiny_dir, "--served-model-name", "tiny", *ENGINE_ARGS], log_level="info")
    yield srv
    # SIGTERM is a graceful shutdown: uvicorn drains, the engine loop stops, then uvicorn
    # re-raises the signal so the exit status still says why the process ended.
    assert srv.stop() in (0, -signal.SIGTERM), srv.log[-3000:]
    assert "Application shutdown complete" in srv.log
    assert "jaxllm: engine shut down" in srv.log


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as c:
        yield c


def assert_idle(server, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (server.value("jaxllm:num_requests_running") == 0
                and server.value("jaxllm:num_requests_waiting") == 0
                and server.value("jaxllm:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: {server.metrics()}")


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.usage.completion_tokens == 12
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_equals_non_stream(client):
    kw = dict(model="tiny", max_tokens=10, temperature=0, seed=1,
              messages=[{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}])
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(stream=True, **kw))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert full.usage.prompt_tokens > 0 and full.usage.total_tokens == (
        full.usage.prompt_tokens + full.usage.completion_tokens)


def test_sampling_extras_n_seed_stop_and_logprobs(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, n=3,
                                    temperature=1.0, seed=5, logprobs=2,
                                    extra_body={"top_k": 20, "min_p": 0.01,
                                                "repetition_penalty": 1.1, "ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    again = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, n=3,
                                      temperature=1.0, seed=5, logprobs=2,
                                      extra_body={"top_k": 20, "min_p": 0.01,
                                                  "repetition_penalty": 1.1, "ignore_eos": True})
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    # vLLM's rule: the sampled token and the top 2 (3 when the sampled one is not in them)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3,
                                          messages=[{"role": "user", "content": "Yo"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    stopped = client.completions.create(model="tiny", prompt="Hello", max_tokens=30,
                                        temperature=0, stop=[" "],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason in ("stop", "length")
    assert " " not in stopped.choices[0].text


def test_bad_words_and_allowed_token_ids(client, server):
    def ids(text):
        return httpx.post(server.url + "/tokenize",
                          json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    [cat], [dog] = ids(" cat"), ids(" dog")
    kw = dict(model="tiny", prompt="The capital of France is", max_tokens=4, temperature=0)
    # "cat" bans both "cat" and " cat" (vLLM tokenizes each bad word with and without a
    # leading space), so of the two allowed tokens only " dog" is left.
    out = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": ["cat"],
                                                     "allowed_token_ids": [cat, dog]})
    text = httpx.post(server.url + "/detokenize", json={"tokens": [dog] * 4}).json()["prompt"]
    assert out.choices[0].text == text
    out = client.completions.create(**kw, extra_body={"ignore_eos": True,
                                                     "allowed_token_ids": [cat]})
    text = httpx.post(server.url + "/detokenize", json={"tokens": [cat] * 4}).json()["prompt"]
    assert out.choices[0].text == text
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "x", "allowed_token_ids": []})
    assert r.status_code == 400 and "allowed_token_ids" in r.json()["error"]["message"]


def test_sse_framing_is_raw_openai(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True,
            "ignore_eos": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "Invalid JSON"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "bogus_field": 1}, 400, "bogus_field"),
    ({"prompt": [5] * 300}, 400, "maximum model length"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "does not exist"),
    ({"prompt": "x", "n": 2, "temperature": 0}, 400, "greedy"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
])
def test_errors_are_openai_json_with_the_right_status(server, body, status, fragment):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert fragment in error["message"] or fragment == error["param"]


def test_chat_errors(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": 5, "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_models_tokenize_detokenize_version(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 256
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    assert httpx.post(server.url + "/detokenize", json={"tokens": [-4]}).status_code == 400
    assert "version" in httpx.get(server.url + "/version").json()


def test_metrics_are_prometheus_with_histograms(server, client):
    client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("jaxllm:time_to_first_token_seconds_bucket",
                 "jaxllm:inter_token_latency_seconds_count",
                 "jaxllm:e2e_request_latency_seconds_sum",
                 "jaxllm:request_prompt_tokens_bucket", "jaxllm:request_generation_tokens_count",
                 "jaxllm:num_requests_running", "jaxllm:kv_cache_usage_perc",
                 "jaxllm:request_success_total", "jaxllm:prefix_cache_queries"):
        assert name in text, name
    assert server.value("jaxllm:e2e_request_latency_seconds_count") >= 1


def test_256_concurrent_streams_all_complete(server):
    async def one(http, i):
        body = {"prompt": f"Story {i}:", "max_tokens": 8, "temperature": 0.7, "seed": i,
                "stream": True, "ignore_eos": True}
        chunks, done = 0, False
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                done = done or line == "data: [DONE]"
                chunks += line.startswith("data: {")
        return done and chunks > 0

    async def main():
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            return await asyncio.gather(*[one(http, i) for i in range(256)])

    t0 = time.perf_counter()
    results = asyncio.run(main())
    print(f"\n256 concurrent streams: {time.perf_counter() - t0:.1f} s")
    assert results == [True] * 256
    assert_idle(server)


def test_a_client_disconnect_aborts_its_request(server):
    aborted = server.value("jaxllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": "Go on", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # the client closed the connection after 3 lines
    assert_idle(server)
    assert server.value("jaxllm:request_success_total", finished_reason="abort") == aborted + 1


def test_api_key(tiny_dir):
    srv = RemoteServer([tiny_dir, *ENGINE_ARGS, "--enforce-eager", "true"],
                       env={"JAXLLM_API_KEY": "s3cret"})
    try:
        body = {"prompt": "x", "max_tokens": 1}
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
        r = httpx.post(srv.url + "/v1/completions", json=body,
                       headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200  # not under /v1
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret") as ok:
            assert ok.completions.create(model=tiny_dir, prompt="x", max_tokens=1).choices
    finally:
        srv.stop()
