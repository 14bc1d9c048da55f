"""AsyncLLM on the tiny model: output kinds, abort and cancellation, bad input, a dead engine.

Each test runs its coroutines on a fresh event loop against one shared AsyncLLM (its engine
loop lives in a thread, so it serves any loop).
"""

from __future__ import annotations

import asyncio

import pytest

from jaxllm import AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams
from jaxllm.async_llm import EngineDeadError

from tiny_model import SMALL, greedy, token_ids

PROMPT = {"prompt_token_ids": [100, 200, 300, 400]}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    args = {k: v for k, v in SMALL.items() if k != "use_tqdm_on_load"}
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=tiny_model_dir, **args))
    yield engine
    engine.shutdown()


def run(coro):
    return asyncio.run(coro)


async def collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def params(kind, **kwargs) -> SamplingParams:
    p = greedy(12, **kwargs)
    p.output_kind = kind
    return p


def test_output_kinds_agree_on_the_final_result(engine):
    reference = run(collect(engine, PROMPT, params(RequestOutputKind.FINAL_ONLY, logprobs=2)))
    assert len(reference) == 1 and reference[0].finished
    final = reference[0].outputs[0]
    cumulative = run(collect(engine, PROMPT, params(RequestOutputKind.CUMULATIVE, logprobs=2)))
    delta = run(collect(engine, PROMPT, params(RequestOutputKind.DELTA, logprobs=2)))
    assert len(cumulative) == len(delta) == 12  # one output per generated token
    assert [o.finished for o in delta] == [False] * 11 + [True]
    assert cumulative[-1].outputs[0].token_ids == final.token_ids
    assert cumulative[-1].outputs[0].text == final.text
    # DELTA: the pieces concatenate to the final output exactly.
    assert sum((o.outputs[0].token_ids for o in delta), []) == final.token_ids
    assert "".join(o.outputs[0].text for o in delta) == final.text
    assert sum((o.outputs[0].logprobs for o in delta), []) == final.logprobs


def test_held_back_stop_strings_never_leak_into_a_delta(engine):
    full = run(collect(engine, PROMPT, params(RequestOutputKind.FINAL_ONLY)))[0].outputs[0]
    assert len(full.text) > 12
    stop_str = full.text[8:12]  # a stop string the greedy text will run into
    outs = run(collect(engine, PROMPT, params(RequestOutputKind.DELTA, stop=[stop_str])))
    text = "".join(o.outputs[0].text for o in outs)
    assert text == full.text[:full.text.index(stop_str)]
    seen = ""
    for o in outs:  # no delta ever showed characters that later turned out to be the stop
        seen += o.outputs[0].text
        assert full.text.startswith(seen) and stop_str not in seen
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == stop_str


def test_n_children_stream_under_the_parent_id(engine):
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True,
                       output_kind=RequestOutputKind.DELTA)
    outs = run(collect(engine, PROMPT, p, "fan"))
    assert {o.request_id for o in outs} == {"fan"}
    by_index = {}
    for o in outs:
        for c in o.outputs:
            by_index.setdefault(c.index, []).extend(c.token_ids)
    assert sorted(by_index) == [0, 1, 2] and all(len(t) == 5 for t in by_index.values())
    assert outs[-1].finished and sum(o.finished for o in outs) == 1


def test_abort_ends_the_stream_with_abort_and_frees_blocks(engine):
    async def main():
        p = params(RequestOutputKind.DELTA)
        p.max_tokens = 200
        outs = []
        async for out in engine.generate(PROMPT, p, "to-abort"):
            outs.append(out)
            if len(outs) == 3:
                await engine.abort("to-abort")
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs) < 200
    assert_idle(engine)


def test_cancelling_the_consumer_aborts_the_request(engine):
    async def main():
        p = params(RequestOutputKind.DELTA)
        p.max_tokens = 200
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPT, p, "cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert_idle(engine)


def test_a_stream_dropped_unread_aborts_its_request(engine):
    """A server response that never started (its client left first) drops its stream
    unread: the request must not run on."""
    def aborted():
        return sum(m.value for m in engine.get_metrics()
                   if m.name == "jaxllm:request_success_total"
                   and m.labels.get("finished_reason") == "abort")

    before = aborted()

    async def main():
        p = params(RequestOutputKind.DELTA)
        p.max_tokens = 200
        streams = await engine.add_requests([PROMPT], p, ["unread"])
        assert "unread" in engine.request_ids
        del streams

    run(main())
    for _ in range(500):  # the engine thread applies the admit, then the drop
        if "unread" not in engine.request_ids:
            break
        run(asyncio.sleep(0.01))
    assert "unread" not in engine.request_ids and aborted() == before + 1
    assert_idle(engine)


def test_bad_input_raises_before_anything_is_queued(engine):
    async def main():
        good = asyncio.create_task(collect(engine, PROMPT, params(RequestOutputKind.FINAL_ONLY)))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="temperature"):
            await collect(engine, PROMPT, _mutated(temperature=-1.0))
        with pytest.raises(ValueError, match="longer than the maximum model length"):
            await collect(engine, {"prompt_token_ids": [5] * 300}, greedy(3))
        return await good

    out = run(main())
    assert token_ids(out) == token_ids(run(collect(engine, PROMPT,
                                                   params(RequestOutputKind.FINAL_ONLY))))
    assert_idle(engine)


def _mutated(**fields) -> SamplingParams:
    """Valid at construction, changed after (the check at admission must catch it)."""
    p = greedy(3)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def assert_idle(engine):
    for _ in range(200):  # the engine thread settles the abort
        core = engine.engine
        if not core.has_unfinished_requests() and core.kv_cache_manager.usage == 0.0:
            return
        asyncio.run(asyncio.sleep(0.01))
    raise AssertionError("the engine still holds requests or blocks")


def test_a_dead_engine_fails_every_stream_and_every_later_call(tiny_model_dir):
    args = {k: v for k, v in SMALL.items() if k != "use_tqdm_on_load"}
    engine = AsyncLLM(AsyncEngineArgs(model=tiny_model_dir, **args))

    def broken_step():
        raise MemoryError("the loop itself broke")

    async def main():
        engine.engine.step = broken_step
        results = await asyncio.gather(*[collect(engine, PROMPT, greedy(5)) for _ in range(3)],
                                       return_exceptions=True)
        return results

    try:
        results = run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            run(collect(engine, PROMPT, greedy(5)))
    finally:
        engine.shutdown()


def test_priority_reaches_every_child_from_the_server_and_is_checked(engine, monkeypatch):
    from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from jaxllm.entrypoints.openai.serving import OpenAIServing

    serving = OpenAIServing(engine, ["tiny"], None)
    # The engine's policy is "fcfs": a nonzero priority is refused before anything is queued.
    with pytest.raises(ValueError, match="Got priority 3 but Priority scheduling is not "
                                         "enabled"):
        serving.check_completion(CompletionRequest(prompt=[1, 2, 3], priority=3))
    with pytest.raises(ValueError, match="Got priority -1 but Priority scheduling"):
        serving.check_chat(ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], priority=-1))
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        run(_generate_with_priority(engine, 1))
    assert_idle(engine)

    # Let the front end accept priorities (the fcfs scheduler just ignores their order) and
    # record what reaches the engine core: n children share their parent's priority.
    monkeypatch.setattr(engine.engine.processor, "scheduling_policy", "priority")
    seen = []
    core = engine.engine.engine_core
    add = core.add_request
    monkeypatch.setattr(core, "add_request", lambda r: (seen.append((r.request_id,
                                                                      r.priority)), add(r)))

    async def main():
        body = CompletionRequest(prompt=[1, 2, 3], max_tokens=2, n=2, seed=1, priority=7,
                                 request_id="p")
        await serving.create_completion(body, "tiny")
        chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2, priority=-2, request_id="c")
        await serving.create_chat_completion(chat, "tiny")

    run(main())
    assert seen == [("0_p-0", 7), ("1_p-0", 7), ("c", -2)]
    assert_idle(engine)


async def _generate_with_priority(engine, priority):
    return [out async for out in engine.generate(PROMPT, greedy(2), None, priority=priority)]


def test_a_sample_id_colliding_with_a_streaming_chat_is_a_400_and_the_engine_lives(engine):
    """The repro: a streaming chat runs as "0_x"; a chat "x" with n=2 would run its samples
    as 0_x and 1_x. It is refused (ValueError, the server's 400) and nothing else changes."""
    from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
    from jaxllm.entrypoints.openai.serving import OpenAIServing

    serving = OpenAIServing(engine, ["tiny"], None)
    messages = [{"role": "user", "content": "hi"}]

    async def main():
        first = ChatCompletionRequest(messages=messages, max_tokens=40, ignore_eos=True,
                                      stream=True, request_id="0_x")
        chunks = await serving.create_chat_completion(first, "tiny")
        seen = [await anext(chunks) for _ in range(3)]  # role chunk + two tokens: running
        second = ChatCompletionRequest(messages=messages, max_tokens=4, n=2, request_id="x")
        with pytest.raises(ValueError, match="'x' with n=2 runs its samples as '0_x'"):
            await serving.create_chat_completion(second, "tiny")
        seen += [chunk async for chunk in chunks]
        assert engine.is_running
        again = await serving.create_chat_completion(second, "tiny")  # 0_x has finished
        return seen, again

    seen, again = run(main())
    assert seen[-1] == "data: [DONE]\n\n"
    assert '"finish_reason": "length"' in seen[-2]
    assert [c["index"] for c in again["choices"]] == [0, 1]
    assert engine.is_running
    assert_idle(engine)


def test_ids_are_checked_before_the_engine_thread_admits(engine):
    """Two requests in one event-loop turn: the first is not in the engine yet when the
    second arrives, and its samples' ids are taken all the same."""
    async def main():
        first = asyncio.create_task(collect(engine, PROMPT, greedy(5), "0_y"))
        two = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
        second = asyncio.create_task(collect(engine, PROMPT, two, "y"))
        return await asyncio.gather(first, second, return_exceptions=True)

    first, second = run(main())
    assert isinstance(second, ValueError) and "runs its samples as '0_y'" in str(second)
    assert len(first[-1].outputs[0].token_ids) == 5 and engine.is_running
    assert_idle(engine)


def test_data_parallel_replicas_need_their_own_devices(tiny_model_dir):
    import jax

    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"data_parallel_size={n + 1} x tensor_parallel_size=1 "
                                         f"needs {n + 1} devices, but only {n} are available"):
        AsyncLLM(AsyncEngineArgs(model=tiny_model_dir, data_parallel_size=n + 1))
