"""The engine never dies from a request: a fault in one phase of one request fails that
request alone, on the real engine thread of an AsyncLLM (the server's engine).

One fault per phase, injected by monkeypatching the tiny engine for one request ("victim",
n=2, its second sample "1_victim" is the one that raises):

    admit       LLMEngine.admit -> engine_core.add_request
    schedule    Scheduler.schedule -> kv_cache_manager.allocate_slots
    execute     the runner's dispatch of a step that carries the victim
    update      Scheduler.update_from_output -> _append_until_stop
    detokenize  OutputProcessor -> the sample's IncrementalDetokenizer.update

After each: the victim's stream ends with finish_reason "error" (its other sample aborted
or failed with it), the other requests give their fault-free tokens, the loop still runs,
and nothing is left: no running or waiting request, no KV block, no reserved id.
"""

from __future__ import annotations

import asyncio

import pytest

from jaxllm import AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams

from tiny_model import SMALL, greedy, token_ids

VICTIM = [300 + i for i in range(11)]
OTHERS = {"a": [100 + i for i in range(7)], "b": [200 + i for i in range(19)]}
FAILING = "1_victim"


class Injected(RuntimeError):
    pass


def fail_admit(engine, monkeypatch):
    core = engine.engine_core
    add = core.add_request

    def add_request(request):
        if request.request_id == FAILING:
            raise Injected("admit")
        add(request)

    monkeypatch.setattr(core, "add_request", add_request)


def fail_schedule(engine, monkeypatch):
    kv = engine.kv_cache_manager
    allocate = kv.allocate_slots

    def allocate_slots(request, *args, **kwargs):
        if request.request_id == FAILING:
            raise Injected("schedule")
        return allocate(request, *args, **kwargs)

    monkeypatch.setattr(kv, "allocate_slots", allocate_slots)


def fail_execute(engine, monkeypatch):
    runner = engine.runner
    dispatch = runner.dispatch

    def failing_dispatch(so):
        if FAILING in so.num_scheduled_tokens:
            raise Injected("execute")
        return dispatch(so)

    monkeypatch.setattr(runner, "dispatch", failing_dispatch)


def fail_update(engine, monkeypatch):
    scheduler = engine.scheduler
    append = scheduler._append_until_stop

    def append_until_stop(request, sampled):
        if request.request_id == FAILING:
            raise Injected("update")
        return append(request, sampled)

    monkeypatch.setattr(scheduler, "_append_until_stop", append_until_stop)


def fail_detokenize(engine, monkeypatch):
    processor = engine.output_processor
    add = processor.add_request

    def raising(new_token_ids):
        raise Injected("detokenize")

    def add_request(request, arrival_time):
        add(request, arrival_time)
        if FAILING in processor.children:  # its own detokenizer fails on its first tokens
            processor.children[FAILING].detokenizer.update = raising

    monkeypatch.setattr(processor, "add_request", add_request)


# phase -> (the fault, the victim's finish reasons). A failed step fails every request it
# carried (both samples); elsewhere the failing sample fails and its sibling is aborted.
PHASES = {
    "admit": (fail_admit, ["error", "error"]),
    "schedule": (fail_schedule, ["abort", "error"]),
    "execute": (fail_execute, ["error", "error"]),
    "update": (fail_update, ["abort", "error"]),
    "detokenize": (fail_detokenize, ["abort", "error"]),
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    args = {k: v for k, v in SMALL.items() if k != "use_tqdm_on_load"}
    engine = AsyncLLM(AsyncEngineArgs(model=tiny_model_dir, **args))
    yield engine
    engine.shutdown()


def victim_params() -> SamplingParams:
    return SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


async def last(engine, prompt, params, request_id):
    out = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        pass
    return out


@pytest.fixture(scope="module")
def baseline(engine):
    async def main():
        return {name: await last(engine, p, greedy(8), name) for name, p in OTHERS.items()}

    return {name: token_ids([out])[0] for name, out in asyncio.run(main()).items()}


def assert_idle(engine):
    llm_engine = engine.engine
    for _ in range(200):  # the engine thread may still be settling an abort
        if (not llm_engine.has_unfinished_requests()
                and not llm_engine.output_processor.has_unfinished()
                and llm_engine.kv_cache_manager.usage == 0.0):
            break
        asyncio.run(asyncio.sleep(0.01))
    stats = llm_engine.scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
    assert not llm_engine.output_processor.parents and not llm_engine.output_processor.children
    assert len(engine.request_ids) == 0
    assert engine.is_running


def finished(engine, reason: str) -> float:
    return sum(m.value for m in engine.get_metrics()
               if m.name == "jaxllm:request_success_total"
               and m.labels["finished_reason"] == reason)


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_fault_fails_only_its_own_request(engine, baseline, monkeypatch, phase):
    inject, reasons = PHASES[phase]
    errors_before = finished(engine, "error")
    inject(engine.engine, monkeypatch)

    async def main():
        victim = last(engine, VICTIM, victim_params(), "victim")
        others = [last(engine, p, greedy(8), name) for name, p in OTHERS.items()]
        if phase == "execute":  # a failed step fails all it carried: the victim runs alone
            return [await victim] + [await o for o in others]
        return await asyncio.gather(victim, *others)

    failed, *others = asyncio.run(main())
    assert failed.finished and failed.request_id == "victim"
    assert sorted(c.finish_reason for c in failed.outputs) == reasons
    assert [(c.text, c.token_ids) for c in failed.outputs if c.finish_reason == "error"] == [
        ("", [])] * reasons.count("error")
    assert {o.request_id: token_ids([o])[0] for o in others} == baseline
    assert all(c.finish_reason == "length" for o in others for c in o.outputs)
    assert_idle(engine)
    # /metrics counts each failed sample (a failed admission never reached the output
    # processor, which counts them).
    assert finished(engine, "error") - errors_before == (
        0 if phase == "admit" else reasons.count("error"))

    monkeypatch.undo()  # the same id, fault-free, now runs to its end
    again = asyncio.run(last(engine, VICTIM, victim_params(), "victim"))
    assert [len(c.token_ids) for c in again.outputs] == [8, 8]
    assert_idle(engine)
