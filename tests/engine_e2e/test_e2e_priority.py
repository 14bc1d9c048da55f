"""Priority scheduling end to end on the tiny model.

A KV cache of 12 usable blocks (16 tokens each) against three requests that each grow to 8
blocks forces preemption; the policy decides who gives way: the last admitted with "fcfs",
the largest priority value with "priority". Greedy tokens never depend on it.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM
from jaxllm.engine.processor import parse_prompt

from tiny_model import greedy, token_ids

VOCAB = 49152
TIGHT = dict(max_model_len=128, num_gpu_blocks_override=13)


def prompts(n=3, length=20) -> list[dict]:
    rng = np.random.default_rng(5)
    return [{"prompt_token_ids": rng.integers(3, VOCAB, size=length).tolist()} for _ in range(n)]


@pytest.fixture(scope="module")
def priority_llm(make_tiny_llm):
    return make_tiny_llm(scheduling_policy="priority", **TIGHT)


@pytest.fixture(scope="module")
def fcfs_llm(make_tiny_llm):
    return make_tiny_llm(**TIGHT)


def run_recording(llm, requests, params, priorities):
    """Run through LLMEngine; -> (outputs in input order, ids in the order they finished,
    ids in the order they were preempted)."""
    engine = llm.llm_engine
    scheduler = engine.scheduler
    preempted: list[str] = []
    preempt = scheduler._preempt

    def recording_preempt(request):
        preempted.append(request.request_id)
        preempt(request)

    scheduler._preempt = recording_preempt
    try:
        ids = engine.add_requests([parse_prompt(r) for r in requests], [params] * len(requests),
                                  priorities=priorities)
        done = {}
        order = []
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    order.append(out.request_id)
    finally:
        del scheduler._preempt
    return [done[i] for i in ids], [ids.index(i) for i in order], [
        ids.index(i) for i in dict.fromkeys(preempted)]


def test_priority_decides_who_is_preempted_and_finishes_last(tiny_llm, priority_llm, fcfs_llm):
    requests, params = prompts(), greedy(100)
    roomy = tiny_llm.generate(requests, params, use_tqdm=False)

    fcfs, fcfs_finish, fcfs_preempted = run_recording(fcfs_llm, requests, params, None)
    # The last admitted gives way, then the next: they finish in arrival order.
    assert (fcfs_finish, fcfs_preempted) == ([0, 1, 2], [2, 1])

    # Request 0 is the least important: it gives way although it came first.
    prio, prio_finish, prio_preempted = run_recording(priority_llm, requests, params,
                                                      [2, 1, 0])
    assert (prio_finish, prio_preempted) == ([2, 1, 0], [0, 1])
    assert token_ids(fcfs) == token_ids(prio) == token_ids(roomy)
    assert all(len(t) == 100 for t in token_ids(prio))


def test_generate_with_priority_list(priority_llm):
    requests = prompts(2, 8)
    outs = priority_llm.generate(requests, greedy(4), use_tqdm=False, priority=[5, -1])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


def test_priority_validation(tiny_llm, priority_llm):
    requests = prompts(2, 8)
    with pytest.raises(ValueError, match=r"Got priority 1 but Priority scheduling is not "
                                         r"enabled"):
        tiny_llm.generate(requests, greedy(2), use_tqdm=False, priority=[0, 1])
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    tiny_llm.generate(requests, greedy(2), use_tqdm=False, priority=[0, 0])  # fine with fcfs
    with pytest.raises(ValueError, match=r"lengths of prompts \(2\) and priority \(3\)"):
        priority_llm.generate(requests, greedy(2), use_tqdm=False, priority=[0, 1, 2])
    with pytest.raises(ValueError, match="priority must be an int, got str"):
        priority_llm.generate(requests, greedy(2), use_tqdm=False, priority=[0, "1"])
    with pytest.raises(ValueError, match="priority must be an int, got bool"):
        priority_llm.generate(requests, greedy(2), use_tqdm=False, priority=[True, 0])
    with pytest.raises(ValueError, match="priority must be an int or a list of ints"):
        priority_llm.generate(requests, greedy(2), use_tqdm=False, priority="3")
    with pytest.raises(ValueError, match=r"Got priority 3 but Priority scheduling"):
        tiny_llm.generate(requests, greedy(2), use_tqdm=False, priority=3)  # one int: all
    assert not priority_llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', "
                                         r"'priority'\), got 'lifo'"):
        LLM("unused", scheduling_policy="lifo")


# Ported from vLLM's tests/entrypoints/llm/test_generate.py (test_multiple_priority,
# test_single_prompt_priority). Adaptations: the tiny random Llama instead of vLLM's model,
# greedy(2) instead of sampling_params=None (the default, 16 tokens, only costs time), and
# ValueError for VLLMValidationError (which is a ValueError in vLLM).
VLLM_PROMPTS = ["Hello, my name is", "The president of the United States is",
                "The capital of France is", "The future of AI is"]


def test_multiple_priority(tiny_llm):
    outputs = tiny_llm.generate(VLLM_PROMPTS, greedy(2), use_tqdm=False, priority=None)
    assert len(VLLM_PROMPTS) == len(outputs)
    outputs = tiny_llm.generate(VLLM_PROMPTS, greedy(2), use_tqdm=False,
                                priority=[0] * len(VLLM_PROMPTS))
    assert len(VLLM_PROMPTS) == len(outputs)
    with pytest.raises(ValueError):
        tiny_llm.generate(VLLM_PROMPTS, greedy(2), use_tqdm=False,
                          priority=[0] * (len(VLLM_PROMPTS) - 1))
    with pytest.raises(ValueError):
        tiny_llm.generate(VLLM_PROMPTS, greedy(2), use_tqdm=False, priority=[])


def test_single_prompt_priority(tiny_llm):
    # Single string prompts should be normalized to one request.
    outputs = tiny_llm.generate(VLLM_PROMPTS[0], greedy(2), use_tqdm=False, priority=[0])
    assert len(outputs) == 1


def test_one_int_priority_for_every_prompt_and_in_chat(priority_llm):
    requests = prompts(2)
    # An int is every prompt's priority: the same tokens as the list spelling it out.
    as_int = priority_llm.generate(requests, greedy(2), use_tqdm=False, priority=-1)
    as_list = priority_llm.generate(requests, greedy(2), use_tqdm=False, priority=[-1, -1])
    assert [o.outputs[0].token_ids for o in as_int] == [o.outputs[0].token_ids
                                                        for o in as_list]
    chat = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    assert len(priority_llm.chat(chat, greedy(2), use_tqdm=False, priority=[1, 2])) == 2
    assert len(priority_llm.chat(chat, greedy(2), use_tqdm=False, priority=4)) == 2
    with pytest.raises(ValueError, match=r"lengths of prompts \(2\) and priority \(1\)"):
        priority_llm.chat(chat, greedy(2), use_tqdm=False, priority=[1])
    assert not priority_llm.llm_engine.has_unfinished_requests()
