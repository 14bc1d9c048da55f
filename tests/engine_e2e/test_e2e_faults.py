"""A failure inside a step fails that step's requests, not the engine.

A fault is injected into the runner on a chosen step, in both scheduling modes, and three
things are checked: the requests that step carried finish with an error (the caller gets the
exception, their blocks are freed), everything else keeps running to the tokens it gives
without a fault, and `generate` never hangs. A fault that also consumes the donated KV cache
(as a device failure would) is recovered by recomputing the requests still running.
"""

from __future__ import annotations

import jax
import pytest

from jaxllm.engine.core import StepFailed

from tiny_model import greedy, metric_values, token_ids

PROMPTS = [[100 + i for i in range(n)] for n in (5, 23, 9)]


class Injected(RuntimeError):
    pass


def inject(monkeypatch, runner, on_call: int, consume_cache: bool = False):
    """Make the runner's device launch raise on its `on_call`-th call (1-based)."""
    real_run = runner.run
    calls = {"n": 0}

    def run(host):
        calls["n"] += 1
        if calls["n"] == on_call:
            if consume_cache:  # what a failed computation leaves behind: donated, gone
                for a in jax.tree.leaves(runner.kv_caches):
                    a.delete()
            raise Injected(f"fault on call {on_call}")
        return real_run(host)

    monkeypatch.setattr(runner, "run", run)
    return calls


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, make_tiny_llm):
    return make_tiny_llm(max_num_seqs=2, async_scheduling=request.param)


@pytest.fixture(scope="module")
def baseline(llm):
    return [token_ids(llm.generate({"prompt_token_ids": p}, greedy(8), use_tqdm=False))[0]
            for p in PROMPTS]


def assert_clean(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.has_unfinished()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks - 1
    assert metric_values(llm)["jaxllm:kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("on_call", [1, 3])
def test_generate_raises_frees_everything_and_the_next_call_works(llm, baseline, monkeypatch,
                                                                  on_call):
    inject(monkeypatch, llm.llm_engine.runner, on_call)
    with pytest.raises(StepFailed) as info:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(8), use_tqdm=False)
    assert isinstance(info.value.__cause__, Injected)
    assert info.value.req_ids  # the step's own requests, finished with an error
    assert_clean(llm)
    monkeypatch.undo()
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(8), use_tqdm=False)
    assert token_ids(again) == baseline


def test_only_the_failed_steps_requests_fail(llm, baseline, monkeypatch):
    """max_num_seqs=2: the third request waits while the fault hits the two running ones,
    then runs to its fault-free tokens."""
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, greedy(8)) for p in PROMPTS]
    engine.step()
    calls = inject(monkeypatch, engine.runner, on_call=2)
    failed, done = None, {}
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:  # engine.add_request streams CUMULATIVE outputs
                    done[out.request_id] = out
        except StepFailed as e:
            assert failed is None
            failed = e
    assert calls["n"] >= 2 and failed is not None
    assert sorted(failed.req_ids) == sorted(ids[:2])
    assert sorted(done) == [ids[2]]
    assert token_ids([done[ids[2]]]) == [baseline[2]]
    assert_clean(llm)


def test_a_fault_that_consumes_the_kv_cache_is_recovered(llm, baseline, monkeypatch):
    """The failed step's requests fail; the one waiting recomputes on a fresh cache."""
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, greedy(8)) for p in PROMPTS]
    engine.step()
    inject(monkeypatch, engine.runner, on_call=2, consume_cache=True)
    done, failures = {}, []
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:  # engine.add_request streams CUMULATIVE outputs
                    done[out.request_id] = out
        except StepFailed as e:
            failures.append(e)
    assert len(failures) == 1 and sorted(failures[0].req_ids) == sorted(ids[:2])
    assert token_ids([done[ids[2]]]) == [baseline[2]]
    assert engine.runner.device_state_ok()
    assert_clean(llm)
