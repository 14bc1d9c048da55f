"""The pooling server's app (entrypoints/openai/pooling_server.py) in-process over the shared
MiniLM engine: /v1/embeddings through the openai client (its default base64 and float)
returns the offline embeddings exactly; /pooling, /score, /rerank shapes; the 400s with
OpenAI's error JSON."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from jaxllm.entrypoints.openai.pooling_server import build_pooling_app

TEXTS = ["A cat sat on the mat.", "Rain again today.", "The quick brown fox."]


@pytest.fixture(scope="module")
def app(minilm):
    return build_pooling_app(minilm.llm_engine, served_model_names=["minilm"])


def call(app, fn):
    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://jaxllm") as http:
            return await fn(http)
    return asyncio.run(run())


def post(app, path, body):
    return call(app, lambda http: http.post(path, json=body))


def test_openai_client_gets_the_offline_embeddings_exactly(app, minilm):
    import openai

    offline = np.array([o.outputs.embedding for o in minilm.embed(TEXTS)], np.float32)

    async def create(http, **kw):
        client = openai.AsyncOpenAI(base_url="http://jaxllm/v1", api_key="x", http_client=http)
        return await client.embeddings.create(model="minilm", input=TEXTS, **kw)

    for kw in ({}, {"encoding_format": "float"}):  # the client's default is base64
        res = call(app, lambda http: create(http, **kw))
        got = np.array([d.embedding for d in res.data], np.float32)
        assert np.array_equal(got, offline), kw
        assert [d.index for d in res.data] == [0, 1, 2]
        n = sum(len(o.prompt_token_ids) for o in minilm.embed(TEXTS))
        assert (res.usage.prompt_tokens, res.usage.total_tokens) == (n, n)


def test_inputs_as_token_ids_and_one_string(app, minilm):
    ids = minilm.embed(TEXTS[:2])
    body = post(app, "/v1/embeddings", {"input": [o.prompt_token_ids for o in ids]}).json()
    assert [d["embedding"] for d in body["data"]] == [o.outputs.embedding for o in ids]
    one = post(app, "/v1/embeddings", {"input": ids[0].prompt_token_ids}).json()
    assert one["data"][0]["embedding"] == ids[0].outputs.embedding
    text = post(app, "/v1/embeddings", {"input": TEXTS[0]}).json()
    assert text["data"][0]["embedding"] == ids[0].outputs.embedding


def test_pooling_score_and_rerank(app, minilm):
    pooled = post(app, "/pooling", {"input": TEXTS[:1]}).json()
    assert pooled["data"][0]["object"] == "pooling"
    assert pooled["data"][0]["data"] == \
        minilm.encode(TEXTS[:1], pooling_task="embed")[0].outputs.data.tolist()
    offline = [s.outputs.score for s in minilm.score(TEXTS[0], TEXTS[1:])]
    score = post(app, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in score["data"]] == offline
    rerank = post(app, "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:],
                                      "top_n": 1}).json()
    best = int(np.argmax(offline))
    assert rerank["results"] == [{"index": best, "relevance_score": offline[best],
                                  "document": {"text": TEXTS[1:][best]}}]


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "input must not be an empty list"),
    ({"input": " ".join(["word"] * 200)}, "longer than the model's maximum context length"),
    ({"input": "hi", "dimensions": 8}, "matryoshka"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_requests_are_400_with_openai_error_json(app, body, message):
    res = post(app, "/v1/embeddings", body)
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert message in error["message"]


def test_api_key(minilm):
    locked = build_pooling_app(minilm.llm_engine, served_model_names=["m"], api_key="k")
    assert post(locked, "/v1/embeddings", {"input": "hi"}).status_code == 401
    ok = call(locked, lambda http: http.post("/v1/embeddings", json={"input": "hi"},
                                             headers={"authorization": "Bearer k"}))
    assert ok.status_code == 200


def test_truncation_and_unknown_model(app):
    ok = post(app, "/v1/embeddings", {"input": " ".join(["word"] * 200),
                                      "truncate_prompt_tokens": 16})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 16
    missing = post(app, "/v1/embeddings", {"input": "hi", "model": "other"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"


def test_pooling_token_task_rows_per_token(app, minilm_tokens):
    tokens_app = build_pooling_app(minilm_tokens.llm_engine, served_model_names=["minilm"])
    want = minilm_tokens.encode(TEXTS[:2], pooling_task="token_embed")
    body = post(tokens_app, "/pooling", {"input": TEXTS[:2]}).json()  # the engine's task
    assert [d["data"] for d in body["data"]] == [o.outputs.data.tolist() for o in want]
    bad = post(app, "/pooling", {"input": TEXTS[:1], "task": "token_embed"})
    assert bad.status_code == 400 and "pooler_config" in bad.json()["error"]["message"]
