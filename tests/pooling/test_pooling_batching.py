"""PoolingBatcher (jaxllm/pooling/batching.py) over the shared MiniLM engine: concurrent jobs
share steps and get exactly the offline rows; a bad job fails alone; a failed step fails only
the jobs in flight and leaves nothing queued; close() fails what is still waiting."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from jaxllm.entrypoints.openai.pooling_server import build_pooling_app
from jaxllm.pooling import offline
from jaxllm.pooling.batching import PoolingBatcher

TEXTS = ["A cat sat on the mat.", "Rain again today.", "The quick brown fox.",
         "Tea or coffee?"]


@pytest.fixture
def engine(minilm):
    return minilm.llm_engine


@pytest.fixture
def steps(engine, monkeypatch):
    """The row count of every step the runner executes."""
    seen = []
    execute = engine.runner.execute

    def recording(inputs):
        seen.append(len(inputs))
        return execute(inputs)

    monkeypatch.setattr(engine.runner, "execute", recording)
    return seen


def submit(batcher, texts, task="embed"):
    return batcher.submit(*offline.pooling_inputs(texts), task)


def test_jobs_queued_together_share_one_step_and_match_offline(minilm, engine, steps):
    want = [o.outputs.embedding for o in minilm.embed(TEXTS)]
    steps.clear()
    batcher = PoolingBatcher(engine)
    futures = [submit(batcher, TEXTS[:1]), submit(batcher, TEXTS[1:3]),
               submit(batcher, TEXTS[3:])]
    batcher.start()
    got = [f.result(timeout=60) for f in futures]
    batcher.close()
    assert steps == [4]  # three jobs, four prompts, one step
    assert [[o.outputs.data.tolist() for o in job] for job in got] == \
        [want[:1], want[1:3], want[3:]]
    assert not engine.scheduler.has_unfinished_requests()


def test_a_bad_job_fails_alone_and_adds_nothing(minilm, engine, steps):
    batcher = PoolingBatcher(engine)
    good = submit(batcher, TEXTS[:2])
    bad = submit(batcher, [TEXTS[2], " ".join(["word"] * 200)])  # over max_model_len=64
    batcher.start()
    assert len(good.result(timeout=60)) == 2
    with pytest.raises(ValueError, match="longer than the model's maximum context length"):
        bad.result(timeout=60)
    batcher.close()
    assert steps == [2]  # the bad job's good prompt never ran either
    assert not engine.scheduler.has_unfinished_requests()


def test_a_failed_step_fails_the_jobs_in_flight_then_the_next_job_runs(engine, monkeypatch):
    step = engine.step
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return step()

    monkeypatch.setattr(engine, "step", failing_once)
    batcher = PoolingBatcher(engine)
    first = submit(batcher, TEXTS)
    batcher.start()
    with pytest.raises(RuntimeError, match="device lost"):
        first.result(timeout=60)
    assert not engine.scheduler.has_unfinished_requests()
    later = submit(batcher, TEXTS[:1]).result(timeout=60)
    batcher.close()
    assert len(later) == 1 and len(calls) == 2


def test_close_fails_queued_jobs_and_refuses_new_ones(engine):
    batcher = PoolingBatcher(engine)
    queued = submit(batcher, TEXTS[:1])  # never started
    batcher.close()
    with pytest.raises(RuntimeError, match="shut down"):
        queued.result(timeout=5)
    with pytest.raises(RuntimeError, match="shut down"):
        submit(batcher, TEXTS[:1])


def test_concurrent_http_requests_each_get_their_offline_rows(minilm, engine, steps):
    want = [o.outputs.embedding for o in minilm.embed(TEXTS)]
    steps.clear()
    app = build_pooling_app(engine, served_model_names=["m"])

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://jaxllm") as http:
            return await asyncio.gather(*[http.post("/v1/embeddings", json={"input": t})
                                          for t in TEXTS])

    responses = asyncio.run(run())
    assert [r.json()["data"][0]["embedding"] for r in responses] == want
    assert sum(steps) == len(TEXTS)
