"""The measured step-time model that switches speculation off per step
(spec_decode/cost_model.py), on synthetic step times, and its effect on the schedule."""

from __future__ import annotations

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.cost_model import StepCostModel, token_bucket
from jaxllm.spec_decode.scheduling import SpecDecodeScheduling


def measured(fn, buckets=(2, 4, 8, 16, 32, 64, 128, 256, 512)):
    model = StepCostModel(512)
    for T in buckets:
        for _ in range(3):
            model.observe(T, fn(T))
    return model


def test_buckets_and_averages():
    assert [token_bucket(n, 512) for n in (1, 2, 3, 5, 64, 65, 600)] == \
        [2, 2, 4, 8, 64, 128, 512]
    # The 1 + k bucket (k = 4) of an engine that speculates, within range only.
    assert [token_bucket(n, 512, (5,)) for n in (1, 4, 5, 6)] == [2, 4, 5, 8]
    assert token_bucket(3, 4, (5,)) == 4
    model = StepCostModel(512)
    assert model.step_time(8) is None and model.should_speculate(8, 4, 2.0)
    model.observe(5, 30.0)  # a compile: an outlier the median forgets
    model.observe(6, 1.0)  # same bucket (8)
    model.observe(7, 1.4)
    assert abs(model.step_time(7) - 1.4) < 1e-12
    model.observe(64, 2.3)
    assert abs(model.step_time(32) - (1.4 + (2.3 - 1.4) * (32 - 8) / (64 - 8))) < 1e-9


def test_memory_bound_speculates_compute_bound_does_not():
    flat = measured(lambda T: 0.010)
    assert all(flat.should_speculate(b, 4, 1.5) for b in (1, 8, 64, 128))
    # 10 ms + 0.1 ms per token: the threshold is where L / t(B (1 + m)) = 1 / t(B).
    model = measured(lambda T: 0.010 + 0.0001 * T)
    decisions = {b: model.should_speculate(b, 4, 2.0) for b in (1, 8, 16, 32, 64)}
    assert decisions == {1: True, 8: True, 16: True, 32: False, 64: False}
    # While off, one step in PROBE_EVERY (16) speculates, to keep measuring.
    probes = [model.should_speculate(64, 4, 2.0) for _ in range(32)]
    assert sum(probes) == 2 and not any(probes[:13])
    t = model.step_time
    assert 2.0 / t(16 * 5) >= 1 / t(16) and 2.0 / t(32 * 5) < 1 / t(32)
    # A better acceptance moves the threshold up.
    assert model.should_speculate(32, 4, 4.0)


def test_the_scheduler_stops_drafting_when_the_model_says_so():
    kv = KVCacheManager(64, 4, 64)
    spec = SpecDecodeScheduling(SpeculativeConfig(4, "ngram", 2, 1), kv, 64,
                                max_num_batched_tokens=512)
    r = Request("a", [7, 8, 9, 7, 8, 9, 7, 8], SamplingParams(temperature=0.0, max_tokens=9),
                eos_token_id=0, arrival_time=0.0)
    r.num_computed_tokens = 7
    for T in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        spec.observe_step(T, 0.010 + 0.0001 * T)
    spec.begin_step(1)
    assert spec.active and spec.num_new_tokens(r, 1, 512) == 5
    spec.begin_step(64)
    assert not spec.active and spec.num_new_tokens(r, 1, 512) == 1
    assert spec.num_steps_off == 1
