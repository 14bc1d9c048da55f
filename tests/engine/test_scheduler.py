"""Exact unit tests of Request and the token-budget Scheduler (no runner, no jax)."""

import functools

import pytest

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.sampling_params import SamplingParams
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import Scheduler
from jaxllm.messages import ModelRunnerOutput, NewRequestData

EOS = 2


# The real SamplingParams (pure Python); a short max_tokens keeps the runs small.
Params = functools.partial(SamplingParams, max_tokens=16)


def make_scheduler(*, num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8,
                   max_num_batched_tokens=64, enable_caching=False) -> Scheduler:
    # Prefix caching off: these requests share prompts, and the exact block ids below are
    # the scheduler's without it (tests/engine/test_prefix_caching.py covers it on).
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=enable_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len)


def make_request(req_id: str, prompt_len: int, **params) -> Request:
    prompt = [100 + i for i in range(prompt_len)]
    return Request(req_id, prompt, Params(**params), eos_token_id=EOS, arrival_time=0.0)


def runner_output(sched, out, tokens=None, default=7) -> ModelRunnerOutput:
    """Samples for every scheduled request whose prefill is complete (as a runner would)."""
    tokens = tokens or {}
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = sched.requests.get(req_id)
        complete = req is None or req.num_computed_tokens == req.num_tokens
        sampled.append(list(tokens.get(req_id, [default])) if complete else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(sched, tokens=None):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner_output(sched, out, tokens))


def generate(script: list[int], max_model_len=64, prompt_len=4, **params):
    """Run one request, feeding it `script` one token per step; return its final output."""
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(make_request("r", prompt_len, **params))
    new_tokens, last = [], None
    for token in script:
        _, outs = step(sched, {"r": [token]})
        for o in outs:
            new_tokens += o.new_token_ids
            last = o
        if last is not None and last.finished:
            break
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.usage == 0.0
    return new_tokens, last.finish_reason, last.stop_reason


# -- Request ------------------------------------------------------------------------------
def test_request_status_order_and_reasons():
    order = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED,
             RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR]
    assert order == sorted(order)
    assert [RequestStatus.is_finished(s) for s in order] == [False] * 3 + [True] * 4
    assert [RequestStatus.get_finished_reason(s) for s in order] == [
        None, None, None, "stop", "length", "abort", "error"]


def test_request_tokens_grow_through_one_method():
    req = make_request("r", 3)
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (3, 3, 0)
    req.append_output_token_ids(5)
    req.append_output_token_ids([6, 7])
    assert req.output_token_ids == [5, 6, 7]
    assert req.prompt_token_ids == [100, 101, 102]
    assert (req.num_tokens, req.num_output_tokens) == (6, 3)
    req.output_token_ids.append(99)  # a copy: the request is unchanged
    assert req.num_tokens == 6
    with pytest.raises(ValueError, match="must not be empty"):
        Request("e", [], Params(), EOS, 0.0)


# -- budget, chunking, caps -----------------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 20))

    out, outs = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.scheduled_new_reqs == [NewRequestData(
        "a", [100 + i for i in range(20)], [], Params(), [1, 2], 0)]
    assert outs == []  # partial prefill samples nothing

    out, outs = step(sched)
    assert out.num_scheduled_tokens == {"a": 8}
    (cached,) = out.scheduled_cached_reqs
    assert (cached.req_id, cached.new_block_ids, cached.num_computed_tokens) == ("a", [3, 4], 8)
    assert outs == []

    out, outs = step(sched)
    assert out.total_num_scheduled_tokens == 4
    (cached,) = out.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == ([5], 16)
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [7], None)]
    assert sched.requests["a"].num_computed_tokens == 20


def test_running_first_then_waiting_fill_the_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 3))
    sched.add_request(make_request("b", 10))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"]

    sched.add_request(make_request("c", 10))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5, "c": 2}
    assert out.total_num_scheduled_tokens == 8
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a", "b"]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c"]


def test_last_scheduler_output_is_the_latest_schedule():
    sched = make_scheduler(max_num_batched_tokens=8)
    assert sched.last_scheduler_output is None
    sched.add_request(make_request("a", 3))
    first, _ = step(sched)
    assert sched.last_scheduler_output is first
    second = sched.schedule()
    assert sched.last_scheduler_output is second
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs[0].num_computed_tokens == 3


def test_max_num_seqs_caps_running_and_fcfs_admits_the_next():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", 4, max_tokens=1))
    sched.add_request(make_request("b", 4))
    sched.add_request(make_request("c", 4))
    out, outs = step(sched)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert [(o.req_id, o.finish_reason) for o in outs] == [("a", "length"), ("b", None)]

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"b": 1, "c": 4}
    assert out.finished_req_ids == {"a"}
    assert sched.make_stats().num_running_reqs == 2


# -- preemption -------------------------------------------------------------------------------
def test_preemption_from_the_tail_and_resume_with_outputs():
    # 6 usable blocks of 4 tokens; three 8-token prompts fill them exactly.
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24)
    sched.add_request(make_request("a", 8, max_tokens=2))
    sched.add_request(make_request("b", 8))
    sched.add_request(make_request("c", 8))
    sched.add_request(make_request("d", 4))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["a", "b", "c"]  # no block left for d
    kv = sched.kv_cache_manager
    assert [kv.get_block_ids(r) for r in "abc"] == [[1, 2], [3, 4], [5, 6]]
    assert kv.num_free_blocks == 0

    # Each needs a third block for its 9th token: a preempts c (the tail) and takes c's
    # last block first (freed in reverse); b takes the other.
    c = sched.requests["c"]
    out, outs = step(sched)
    assert out.preempted_req_ids == {"c"}
    assert [(r.req_id, r.new_block_ids, r.num_computed_tokens)
            for r in out.scheduled_cached_reqs] == [("a", [6], 8), ("b", [5], 8)]
    assert out.scheduled_new_reqs == []
    assert (c.status, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert c.output_token_ids == [7]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # c goes back to the front
    assert [(o.req_id, o.finish_reason) for o in outs] == [("a", "length"), ("b", None)]
    assert sched.make_stats().num_preemptions == 1

    # a finished and freed [1, 2, 6] tail first: c resumes into them with its output token.
    out, outs = step(sched, {"c": [8]})
    assert out.finished_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1, "c": 9}
    (resumed,) = out.scheduled_new_reqs
    assert resumed == NewRequestData("c", [100 + i for i in range(8)], [7], Params(),
                                     [6, 2, 1], 0)
    assert [(o.req_id, o.new_token_ids) for o in outs] == [("b", [7]), ("c", [8])]
    assert [r.request_id for r in sched.waiting] == ["d"]
    assert c.output_token_ids == [7, 8]
    stats = sched.make_stats()
    assert stats.num_prompt_tokens == 24  # c's prompt is counted once, not again on resume
    assert stats.num_generation_tokens == 3 + 2 + 2


def test_tail_request_preempts_itself_and_fcfs_blocks_behind_it():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 8))
    step(sched)
    out, _ = step(sched)  # b needs a third block; it is the tail, so it preempts itself
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    assert [r.request_id for r in sched.running] == ["a"]
    assert sched.kv_cache_manager.get_block_ids("b") == []

    # b (9 tokens, 3 blocks) cannot fit in the 2 free blocks; d would, but must wait its turn.
    sched.add_request(make_request("d", 4))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["b", "d"]
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 2)
    assert stats.kv_cache_usage == pytest.approx(2 / 4)


# -- stopping -----------------------------------------------------------------------------
@pytest.mark.parametrize("script, params, expected", [
    ([5, EOS, 6], {}, ([5, EOS], "stop", None)),
    ([5, EOS, 6, EOS], dict(ignore_eos=True, max_tokens=3), ([5, EOS, 6], "length", None)),
    ([5, 9, 6], dict(stop_token_ids=[9]), ([5, 9], "stop", 9)),
    ([EOS, 9, EOS, 6], dict(min_tokens=3, stop_token_ids=[9]), ([EOS, 9, EOS], "stop", None)),
    ([5, 6, 7, 8], dict(max_tokens=3), ([5, 6, 7], "length", None)),
    ([5, EOS], dict(max_tokens=2), ([5, EOS], "stop", None)),  # EOS beats max_tokens
    ([5, 9], dict(max_tokens=2, stop_token_ids=[9]), ([5, 9], "stop", 9)),
    ([5, 6, 7], dict(max_model_len=6, max_tokens=100), ([5, 6], "length", None)),
], ids=["eos", "ignore_eos", "stop_token_ids", "min_tokens", "max_tokens", "eos_at_max_tokens",
        "stop_token_at_max_tokens", "max_model_len"])
def test_stopping_rules(script, params, expected):
    assert generate(script, **params) == expected


def test_tokens_after_a_stop_in_one_step_are_dropped():
    sched = make_scheduler()
    sched.add_request(make_request("r", 4))
    _, outs = step(sched, {"r": [5, EOS, 6]})
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([5, EOS], "stop")]
    assert sched.make_stats().num_generation_tokens == 2


# -- finishing from outside ------------------------------------------------------------------
def test_abort_running_request_frees_blocks():
    sched = make_scheduler(num_blocks=9, max_model_len=32)
    req = make_request("a", 10)
    sched.add_request(req)
    step(sched)
    assert sched.kv_cache_manager.num_free_blocks == 5
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 8
    assert req.get_finished_reason() == "abort"
    assert sched.running == [] and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and out.is_empty
    assert sched.schedule().finished_req_ids == set()


def test_abort_waiting_and_unknown_requests():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4))
    sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert sched.get_num_unfinished_requests() == 1
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.finish_requests("b", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4))
    out = sched.schedule()
    ro = runner_output(sched, out)
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    outs = sched.update_from_output(out, ro)
    assert [o.req_id for o in outs] == ["b"]
    assert sched.kv_cache_manager.get_block_ids("a") == []
    assert sched.schedule().finished_req_ids == {"a"}


# -- plumbing ---------------------------------------------------------------------------------
def test_logprobs_are_copied_through():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 6))
    out = sched.schedule()
    ro = ModelRunnerOutput(["a"], [[]], logprobs=[None], prompt_logprobs={"a": "plp0"})
    (o,) = sched.update_from_output(out, ro)
    assert (o.new_token_ids, o.finish_reason, o.new_prompt_logprobs) == ([], None, "plp0")
    out = sched.schedule()
    ro = ModelRunnerOutput(["a"], [[5]], logprobs=["lp"], prompt_logprobs={"a": "plp1"})
    (o,) = sched.update_from_output(out, ro)
    assert (o.new_token_ids, o.new_logprobs, o.new_prompt_logprobs) == ([5], "lp", "plp1")
    assert o.num_cached_tokens == 0


def test_runner_output_must_cover_scheduled_requests():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no entry"):
        sched.update_from_output(out, ModelRunnerOutput([], []))
    with pytest.raises(ValueError, match="1 req_ids"):
        ModelRunnerOutput(["a"], [])


def test_add_request_validation():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", 8))  # a prompt of exactly max_model_len is allowed
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="max_model_len=8"):
        sched.add_request(make_request("b", 9))


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
])
def test_scheduler_config_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_scheduler(**kwargs)


# -- async scheduling: the next step is scheduled before the last one's output arrives ------
def test_async_decode_schedules_the_placeholder_and_folds_tokens_back_in_order():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, max_tokens=4))
    out1 = sched.schedule()  # prefill: samples o0
    req = sched.requests["a"]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (3, 1)
    out2 = sched.schedule()  # decodes o0 before it is known: samples o1
    assert out2.num_scheduled_tokens == {"a": 1}
    assert out2.scheduled_cached_reqs[0].num_computed_tokens == 3
    assert (req.num_computed_tokens, req.num_output_placeholders) == (4, 2)
    first = sched.update_from_output(out1, ModelRunnerOutput(["a"], [[10]]))
    assert [o.new_token_ids for o in first] == [[10]]
    assert (req.num_tokens, req.num_output_placeholders) == (4, 1)
    out3 = sched.schedule()
    assert out3.num_scheduled_tokens == {"a": 1}
    sched.update_from_output(out2, ModelRunnerOutput(["a"], [[11]]))
    # o0 o1 known and o2 in flight: o3 is the last of max_tokens=4, so one more step.
    out4 = sched.schedule()
    assert out4.num_scheduled_tokens == {"a": 1}
    assert req.num_output_placeholders == 2
    # Every remaining token is in flight: nothing more to schedule.
    assert sched.schedule().num_scheduled_tokens == {}
    sched.update_from_output(out3, ModelRunnerOutput(["a"], [[12]]))
    last = sched.update_from_output(out4, ModelRunnerOutput(["a"], [[13]]))
    assert [(o.new_token_ids, o.finish_reason) for o in last] == [([13], "length")]
    assert req.output_token_ids == [10, 11, 12, 13] and not sched.has_unfinished_requests()


def test_async_stop_token_discards_the_step_already_in_flight():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, max_tokens=8))
    out1 = sched.schedule()
    out2 = sched.schedule()
    outs = sched.update_from_output(out1, ModelRunnerOutput(["a"], [[EOS]]))
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([EOS], "stop")]
    assert sched.kv_cache_manager.usage == 0.0
    # The in-flight step's token belongs to a finished request: dropped, no output.
    assert sched.update_from_output(out2, ModelRunnerOutput(["a"], [[5]])) == []
    assert sched.schedule().finished_req_ids == {"a"}


def test_async_preemption_drops_stale_tokens_and_resamples_after_recompute():
    # 3 usable blocks of 4 tokens: a (4 prompt) and b (4 prompt) both grow into a 2nd block.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=12)
    sched.add_request(make_request("a", 4, max_tokens=8))
    sched.add_request(make_request("b", 4, max_tokens=8))
    out1 = sched.schedule()  # both prefill, both sample
    out2 = sched.schedule()  # a decodes into a new block; b cannot and preempts itself
    assert out2.num_scheduled_tokens == {"a": 1} and out2.preempted_req_ids == {"b"}
    b = sched.requests["b"]
    assert (b.num_output_placeholders, b.num_stale_outputs) == (0, 1)
    outs = sched.update_from_output(out1, ModelRunnerOutput(["a", "b"], [[20], [30]]))
    assert [(o.req_id, o.new_token_ids) for o in outs] == [("a", [20])]
    assert b.output_token_ids == [] and b.num_stale_outputs == 0


class Injected(RuntimeError):
    pass


def _fail_for(request_id, call):
    def wrapped(request, *args, **kwargs):
        if request.request_id == request_id:
            raise Injected(request_id)
        return call(request, *args, **kwargs)
    return wrapped


@pytest.mark.parametrize("phase", ["waiting", "running"])
def test_a_request_whose_scheduling_raises_fails_alone(phase):
    """b's own block allocation raises: b finishes with an error and frees its blocks, a and
    c are scheduled as if b had never been there."""
    sched = make_scheduler()
    for req_id in "abc":
        sched.add_request(make_request(req_id, 6))
    if phase == "running":
        step(sched)  # all three prefilled: 2 blocks each (block_size 4)
        assert {r: len(b) for r, b in sched.kv_cache_manager.req_to_blocks.items()} == {
            "a": 2, "b": 2, "c": 2}
    kv = sched.kv_cache_manager
    kv.allocate_slots = _fail_for("b", kv.allocate_slots)
    out = sched.schedule()
    assert sorted(out.num_scheduled_tokens) == ["a", "c"]
    assert out.finished_req_ids == {"b"}  # the runner drops its row (if it had one)
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in sched.take_failed_outputs()
            ] == [("b", [], "error")]
    assert sched.take_failed_outputs() == []
    assert "b" not in sched.requests and "b" not in kv.req_to_blocks
    assert [r.request_id for r in sched.running] == ["a", "c"]
    assert kv.num_free_blocks == kv.num_blocks - 1 - 4


def test_a_request_whose_update_raises_fails_alone():
    sched = make_scheduler()
    for req_id in "abc":
        sched.add_request(make_request(req_id, 6))
    out = sched.schedule()
    sched._append_until_stop = _fail_for("b", sched._append_until_stop)
    outputs = sched.update_from_output(out, runner_output(sched, out, {"a": [11], "c": [13]}))
    assert [(o.req_id, o.new_token_ids) for o in outputs] == [("a", [11]), ("c", [13])]
    assert [(o.req_id, o.finish_reason) for o in sched.take_failed_outputs()] == [
        ("b", "error")]
    assert [r.request_id for r in sched.running] == ["a", "c"]
    assert sorted(sched.kv_cache_manager.req_to_blocks) == ["a", "c"]
