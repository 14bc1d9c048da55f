"""The measured step-time model that sets each step's draft budget
(spec_decode/cost_model.py), on synthetic step times, and its effect on the schedule."""

from __future__ import annotations

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.cost_model import (UNLIMITED, StepCostModel, expected_drafts,
                                          token_bucket)
from jaxllm.spec_decode.scheduling import SpecDecodeScheduling


def measured(fn, buckets=(2, 4, 8, 16, 32, 64, 128, 256, 512), extra=()):
    model = StepCostModel(512, extra)
    for T in buckets:
        for _ in range(3):
            model.observe(T, fn(T))
    return model


def steep(T):  # 1 ms + 0.1 ms per token: compute-bound from a few rows on
    return 0.001 + 0.0001 * T


def test_buckets_and_averages():
    assert [token_bucket(n, 512) for n in (1, 2, 3, 5, 64, 65, 600)] == \
        [2, 2, 4, 8, 64, 128, 512]
    # The 1 + k bucket (k = 4) of an engine that speculates, within range only.
    assert [token_bucket(n, 512, (5,)) for n in (1, 4, 5, 6)] == [2, 4, 5, 8]
    assert token_bucket(3, 4, (5,)) == 4
    assert StepCostModel(48).buckets == (2, 4, 8, 16, 32, 48)
    model = StepCostModel(512)
    assert model.step_time(8) is None and model.draft_budget(8, 1.0, 4, 0.5) == (UNLIMITED, False)
    model.observe(5, 30.0)  # a compile: an outlier the median forgets
    model.observe(6, 1.0)  # same bucket (8)
    model.observe(7, 1.4)
    assert abs(model.step_time(7) - 1.4) < 1e-12
    model.observe(64, 2.3)
    assert abs(model.step_time(32) - (1.4 + (2.3 - 1.4) * (32 - 8) / (64 - 8))) < 1e-9


def test_memory_bound_takes_every_draft_on_offer():
    flat = measured(lambda T: 0.010)
    # 64 rows x 4 drafts fit first in bucket 512; 1 row's 4 first in bucket 8.
    assert flat.draft_budget(64, 1.0, 4, 0.5) == (448, False)
    assert flat.draft_budget(1, 1.0, 4, 0.5) == (7, False)
    # Supply: 64 rows offering 1 draft each fit in bucket 128.
    assert flat.draft_budget(64, 1.0, 1, 0.5) == (64, False)


def test_compute_bound_fills_its_own_bucket_only():
    model = measured(steep)
    # B = 64: bucket 128 would emit 64 + 0.5 x 64 tokens in 13.8 ms, against 64 in 7.4 ms.
    assert model.draft_budget(64, 1.0, 4, 0.5) == (0, True)
    assert 64 / steep(64) > (64 + 0.5 * 64) / steep(128)
    # B = 50 runs in bucket 64 anyway: its 14 padding rows take drafts for free.
    assert model.draft_budget(50, 1.0, 4, 0.5) == (14, True)
    # B = 1: bucket 4 (3 drafts) beats 2 and 8: 2.5 / 1.4 ms > 3 / 1.8 ms > 1 / 1.2 ms.
    assert model.draft_budget(1, 1.0, 4, 0.5) == (3, False)
    # A better acceptance rate moves the threshold: bucket 256 emits 256 tokens in 26.6 ms,
    # more per second than 128 (128 in 13.8 ms) or 64 (64 in 7.4 ms).
    assert model.draft_budget(64, 1.0, 4, 1.0) == (192, False)
    # ... unless the proposals offer too few drafts (a quarter of the rows one each):
    # 80 / 13.8 ms < 64 / 7.4 ms.
    assert model.draft_budget(64, 0.25, 1, 1.0) == (0, True)


def test_a_budget_that_cuts_a_run_short_loses_its_tail():
    # 3 rows, each offering 2 drafts with probability 1/2: hits ~ Binomial(3, 1/2).
    assert abs(expected_drafts(5, 3, 0.5, 2) - (0 * 1 + 2 * 3 + 4 * 3 + 5 * 1) / 8) < 1e-12
    assert expected_drafts(0, 3, 0.5, 2) == 0 and expected_drafts(9, 3, 1.0, 2) == 6
    # Hundreds of rows: no pmf term underflows away.
    assert abs(expected_drafts(1 << 20, 512, 0.95, 4) - 512 * 0.95 * 4) < 1e-6
    # One row that offers 4 drafts 70% of the time: the 1 + k bucket (5) takes the whole
    # run (2.4 tokens in 1.5 ms); by the mean alone (2.8 drafts) bucket 4 would look as good
    # for less time, but it cuts every run to 3 (2.05 tokens in 1.4 ms).
    model = measured(steep, (2, 4, 5, 8, 16), extra=(5,))
    assert abs(expected_drafts(3, 1, 0.7, 4) - 0.7 * 3) < 1e-12
    assert model.draft_budget(1, 0.7, 4, 0.5) == (4, False)


def test_a_draft_models_time_counts_per_proposing_row():
    model = measured(steep)
    # 10 ms per row (a draft model as slow as the target): no drafts, not even the padding's.
    model.observe_proposal(2, 0.020)
    assert model.draft_budget(1, 1.0, 4, 1.0) == (0, True)
    # 0.1 ms per row: bucket 4 (4 tokens in 1.4 + 0.1 ms) beats 8 (5 in 1.8 + 0.1 ms).
    cheap = measured(steep)
    cheap.observe_proposal(1, 0.0001)
    assert cheap.draft_budget(1, 1.0, 4, 1.0) == (3, False)


def test_staying_in_its_own_bucket_probes_the_next_one_now_and_then():
    model = measured(steep)
    budgets = [model.draft_budget(64, 1.0, 4, 0.5) for _ in range(32)]
    # One step in PROBE_EVERY (16) tries bucket 128, so that its time stays measured.
    assert [i for i, b in enumerate(budgets) if b != (0, True)] == [15, 31]
    assert budgets[15] == (64, False)


def test_the_scheduler_drafts_within_the_budget():
    kv = KVCacheManager(64, 4, 64)
    spec = SpecDecodeScheduling(SpeculativeConfig(4, "ngram", 2, 1), kv, 64,
                                max_num_batched_tokens=512)
    r = Request("a", [7, 8, 9, 7, 8, 9, 7, 8], SamplingParams(temperature=0.0, max_tokens=9),
                eos_token_id=0, arrival_time=0.0)
    r.num_computed_tokens = 7
    for T in (2, 4, 5, 8, 16, 32, 64, 128, 256, 512):
        spec.observe_step(T, steep(T))
    # One row: the 1 + k bucket (5) takes all 4 drafts: 3 / 1.5 ms beats bucket 4's 2.5 / 1.4.
    spec.begin_step([r])
    assert spec.draft_budget == 4 and spec.num_new_tokens(r, 1, 512) == 5
    assert spec.draft_budget == 0
    spec.forget(r)  # unscheduled: its drafts go back to the budget
    assert spec.draft_budget == 4 and spec.take_scheduled() == {}
    assert (spec.num_proposals, spec.num_hits, spec.num_proposed_tokens) == (1, 1, 4)
    # 64 rows fill bucket 64 exactly: no drafts.
    spec.begin_step([r] * 64)
    assert not spec.active and spec.num_new_tokens(r, 1, 512) == 1
    assert spec.num_steps_off == 1
    # 62 rows: 2 padding rows of bucket 64, so this row gets 2 of its 4 drafts.
    spec.begin_step([r] * 62)
    assert spec.draft_budget == 2 and spec.num_new_tokens(r, 1, 512) == 3
    assert spec.take_scheduled() == {"a": [9, 7]} and spec.num_steps_off == 2
