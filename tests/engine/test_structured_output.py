"""The host half of structured outputs, exactly: grammars compile off the engine loop and are
cached, a request waits for its grammar while others run, a failed compile fails that
request alone (blocks freed), bitmasks follow the matcher, EOS only where the grammar ends,
and a constrained request is never scheduled with a token in flight (no runner, no jax)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.structured_output import StructuredOutputManager, check_grammar
from jaxllm.messages import ModelRunnerOutput
from jaxllm.models.resolve import embedded_default_gguf
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_outputs import StructuredOutputsConfig, StructuredOutputsParams
from jaxllm.tokenizer import get_tokenizer
from jaxllm.value_ranges import ParameterError

V = 49152  # SmolLM2's vocabulary


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(embedded_default_gguf())


@pytest.fixture
def manager(tokenizer):
    m = StructuredOutputManager(StructuredOutputsConfig(), tokenizer, V)
    yield m
    m.shutdown()


def allowed(bitmask_row: np.ndarray) -> np.ndarray:
    bits = bitmask_row.view(np.uint32)
    return np.flatnonzero((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1)


def choice(*options) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=list(options))


@pytest.mark.parametrize("kwargs, field", [
    (dict(regex="[a-z"), "structured_outputs.regex"),
    (dict(json={"type": "objectx"}), "structured_outputs.json"),
    (dict(grammar="start: foo"), "structured_outputs.grammar"),
])
def test_invalid_constraints_fail_admission_naming_the_field(kwargs, field):
    with pytest.raises(ParameterError, match=f"{field} is invalid") as info:
        check_grammar(StructuredOutputsParams(**kwargs))
    assert info.value.param == field


def test_compiles_are_cached_by_spec(manager):
    a = manager.grammar_init(StructuredOutputsParams(json={"type": "object", "x": 1}))
    b = manager.grammar_init(StructuredOutputsParams(json='{"x": 1, "type": "object"}'))
    c = manager.grammar_init(choice("yes", "no"))
    a.future.result(), c.future.result()
    assert a.future is b.future and manager.num_compiles == 2
    assert a.is_ready() and b.is_ready() and a.matcher is not b.matcher  # own state each


def test_bitmask_follows_the_matcher_and_allows_eos_only_at_the_end(manager, tokenizer):
    request = manager.grammar_init(choice("yes", "no"))
    request.future.result()
    assert request.is_ready()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    first = allowed(manager.grammar_bitmask([request])[0, 0])
    assert yes[0] in first and eos not in first
    manager.accept_tokens(request, yes)
    assert allowed(manager.grammar_bitmask([request])[0, 0]).tolist() == [eos]
    manager.accept_tokens(request, [eos])  # ends it; the matcher stays where it was
    with pytest.raises(ValueError, match="the grammar refused sampled token"):
        manager.accept_tokens(manager_ready(manager, choice("yes", "no")),
                              tokenizer.encode("maybe", add_special_tokens=False))


def manager_ready(manager, params):
    request = manager.grammar_init(params)
    request.future.result()
    assert request.is_ready()
    return request


def make_scheduler(manager, num_blocks=64):
    kv = KVCacheManager(num_blocks, 4, 64, enable_caching=False)
    return Scheduler(kv, 8, 64, 64, structured_output_manager=manager)


def add(sched, req_id, constraint=None, prompt_len=4):
    params = SamplingParams(max_tokens=8, structured_outputs=constraint)
    sched.add_request(Request(req_id, list(range(100, 100 + prompt_len)), params, 2, 0.0))


def test_drafts_are_checked_and_masked_per_position_and_the_matcher_stays(manager, tokenizer):
    """Speculative decoding's half: how many drafts the grammar accepts, and the mask at
    each verify position (row 1 + j: after j drafts) and at the sampled one (row 0: after
    all), the matcher rolled back afterwards; rows of a request with fewer drafts allow all."""
    eos = tokenizer.eos_token_id
    digits = list(range(32, 42))  # "0".."9"
    assert tokenizer.convert_ids_to_tokens(digits) == list("0123456789")
    two = manager_ready(manager, StructuredOutputsParams(regex="[0-9]{2}"))
    one = manager_ready(manager, StructuredOutputsParams(regex="[0-9]"))
    assert manager.validate_drafts(two, [33, 34, 35]) == 2  # a third digit: too many
    assert manager.validate_drafts(two, [81, 33]) == 0  # "a"
    masks = manager.grammar_bitmask([two, one], [[33, 34], []])
    assert masks.shape == (2, 3, V // 32)
    assert allowed(masks[0, 1]).tolist() == digits  # verifies draft 0
    assert allowed(masks[0, 2]).tolist() == digits  # after "1": verifies draft 1
    assert allowed(masks[0, 0]).tolist() == [eos]  # after "12": samples
    assert allowed(masks[1, 0]).tolist() == digits
    assert (masks[1, 1:] == -1).all()
    # Both matchers are where they were.
    again = manager.grammar_bitmask([two, one])
    assert again.shape == (2, 1, V // 32)
    assert allowed(again[0, 0]).tolist() == digits == allowed(again[1, 0]).tolist()


def test_request_waits_for_its_grammar_while_others_run(manager, tokenizer):
    gate = threading.Event()
    compile_ = manager._compile
    manager._compile = lambda params: (gate.wait(), compile_(params))[1]
    sched = make_scheduler(manager)
    add(sched, "slow", choice("a", "b"))
    add(sched, "plain")
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["plain"]
    assert [r.request_id for r in sched.waiting] == ["slow"]
    assert out.grammar_bitmask is None and out.structured_output_request_ids == []
    gate.set()
    sched.requests["slow"].structured_output_request.future.result()
    sched.update_from_output(out, ModelRunnerOutput(["plain"], [[7]]))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"plain": 1, "slow": 4}
    assert out.structured_output_request_ids == ["slow"]
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    assert out.grammar_bitmask.shape == (1, 1, V // 32)
    assert a in allowed(out.grammar_bitmask[0, 0])


def test_failed_compile_fails_that_request_alone(manager):
    def broken(params):
        raise ValueError("structured_outputs.choice is invalid: boom")
    manager._compile = broken
    sched = make_scheduler(manager)
    add(sched, "bad", choice("a"))
    add(sched, "good")
    sched.requests["bad"].structured_output_request.future.exception()  # compiled (failed)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["good"]
    [failed] = sched.take_failed_outputs()
    assert (failed.req_id, failed.finish_reason) == ("bad", "error")
    assert "bad" not in sched.requests and sched.kv_cache_manager.usage > 0  # good's blocks


def test_constrained_request_never_runs_with_a_token_in_flight(manager, tokenizer):
    sched = make_scheduler(manager)
    add(sched, "c", choice("hello world"))
    sched.requests["c"].structured_output_request.future.result()
    first = sched.schedule()  # prefill: samples, so its token is in flight
    assert first.structured_output_request_ids == ["c"]
    second = sched.schedule()  # async: scheduled before the first is folded back
    assert second.is_empty and second.grammar_bitmask is None
    token = allowed(first.grammar_bitmask[0, 0])[0]
    sched.update_from_output(first, ModelRunnerOutput(["c"], [[int(token)]]))
    assert sched.schedule().structured_output_request_ids == ["c"]


def test_refused_token_fails_the_request_and_frees_its_blocks(manager, tokenizer):
    sched = make_scheduler(manager)
    add(sched, "c", choice("yes"))
    add(sched, "plain")
    sched.requests["c"].structured_output_request.future.result()
    out = sched.schedule()
    no = tokenizer.encode("no", add_special_tokens=False)[0]
    outputs = sched.update_from_output(out, ModelRunnerOutput(["c", "plain"], [[no], [7]]))
    assert [o.req_id for o in outputs] == ["plain"]
    [failed] = sched.take_failed_outputs()
    assert (failed.req_id, failed.finish_reason) == ("c", "error")
    assert list(sched.requests) == ["plain"]
    assert sched.kv_cache_manager.get_block_ids("c") == []


class FakeRunner:
    """Samples the first token a row's bitmask allows (7 for plain rows); records steps."""

    def __init__(self):
        self.dispatched = []

    def dispatch(self, so):
        if so.is_empty:
            return None
        self.dispatched.append(so)
        return so

    def fetch(self, so):
        if so is None:
            return ModelRunnerOutput([], [])
        masks = dict(zip(so.structured_output_request_ids,
                         so.grammar_bitmask if so.grammar_bitmask is not None else []))
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, [[int(allowed(masks[r][0])[0])] if r in masks else [7]
                                           for r in req_ids])

    def execute_model(self, so):
        return self.fetch(self.dispatch(so))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_core_samples_constrained_rows_every_step(manager, tokenizer, async_scheduling):
    from jaxllm.engine.core import EngineCore
    sched = make_scheduler(manager)
    runner = FakeRunner()
    core = EngineCore(sched, runner, async_scheduling=async_scheduling)
    add(sched, "c", choice("hello world"))
    add(sched, "plain")
    sched.requests["c"].structured_output_request.future.result()
    tokens = {"c": [], "plain": []}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.req_id] += out.new_token_ids
    forced = tokenizer.encode("hello world", add_special_tokens=False)
    assert tokens["c"] == forced + [tokenizer.eos_token_id]
    assert tokens["plain"] == [7] * 8
    # Every step that ran "c" sampled it under its mask: never skipped, never a stale mask.
    with_c = [so for so in runner.dispatched if "c" in so.num_scheduled_tokens]
    assert len(with_c) == len(forced) + 1
    assert all(so.structured_output_request_ids == ["c"] for so in with_c)
