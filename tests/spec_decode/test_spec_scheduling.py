"""The scheduler's half of speculative decoding (spec_decode/scheduling.py) with exact block
ids: drafts scheduled as 1 + m tokens, rollback of rejected drafts, blocks that held only
rejected drafts given back, drafts dropped on preemption, and rows that may not speculate."""

from __future__ import annotations

from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.messages import ModelRunnerOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.scheduling import SpecDecodeScheduling

BS = 4
LOOP = [7, 8, 9, 7, 8, 9, 7]  # prompt lookup drafts "8 9 7 8" from here


def make(num_blocks=32, k=4, budget=32, max_model_len=64):
    kv = KVCacheManager(num_blocks, BS, max_model_len, enable_caching=True)
    spec = SpecDecodeScheduling(SpeculativeConfig(k, "ngram", 2, 1), kv, max_model_len)
    return Scheduler(kv, 4, budget, max_model_len, spec_decoding=spec), kv, spec


def request(req_id, prompt=LOOP, **params):
    params = {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True, **params}
    return Request(req_id, prompt, SamplingParams(**params), eos_token_id=0,
                   arrival_time=0.0)


def run(sched, so, tokens: dict[str, list[int]]):
    ids = list(so.num_scheduled_tokens)
    return sched.update_from_output(so, ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[tokens.get(r, []) for r in ids]))


def test_drafts_rollback_and_blocks_freed():
    sched, kv, spec = make()
    sched.add_request(request("a"))
    so = sched.schedule()  # prefill of 7: no drafts yet
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"a": 7}
    run(sched, so, {"a": [8]})  # history ... 9 7 8 -> drafts 9 7 8 9
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [9, 7, 8, 9]}
    assert so.num_scheduled_tokens == {"a": 5}
    r = sched.requests["a"]
    assert r.num_computed_tokens == 12 and kv.get_block_ids("a") == [1, 2, 3]
    # d0 accepted, d1 rejected (5 recovered): 2 tokens out, 3 drafts rolled back.
    run(sched, so, {"a": [9, 5]})
    assert r.output_token_ids == [8, 9, 5]
    assert r.num_computed_tokens == 9  # 7 + the 8 fed + the accepted 9
    assert kv.get_block_ids("a") == [1, 2, 3]  # block 3 still holds position 8
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 4, 1)
    assert spec.accepted_per_pos.tolist() == [1, 0, 0, 0]


def test_a_block_of_only_rejected_drafts_is_given_back_and_the_runner_told():
    sched, kv, spec = make()
    sched.add_request(request("a", prompt=[1, 2, 3, 1, 2, 3, 1]))
    run(sched, sched.schedule(), {"a": [2]})  # 8 tokens: blocks 1, 2 full
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [3, 1, 2, 3]}
    assert kv.get_block_ids("a") == [1, 2, 3]  # positions 8..11 in block 3
    run(sched, so, {"a": [6]})  # d0 rejected at once
    assert sched.requests["a"].num_computed_tokens == 8
    assert kv.get_block_ids("a") == [1, 2]  # block 3 held only rejected drafts
    so = sched.schedule()
    (cached,) = so.scheduled_cached_reqs
    # Block 3 went to the back of the free queue; the next fresh block is 4.
    assert cached.num_blocks_before == 2 and cached.new_block_ids == [4]


def test_stop_and_max_tokens_cut_a_run_and_ineligible_rows_get_no_drafts():
    sched, kv, spec = make()
    sched.add_request(request("a", max_tokens=3))
    sched.add_request(request("b", presence_penalty=0.5))
    sched.add_request(request("c", stop_token_ids=[7]))
    run(sched, sched.schedule(), {"a": [8], "b": [8], "c": [8]})
    so = sched.schedule()
    # a may emit 2 more tokens: 1 draft (+ the bonus); b has a penalty: none.
    assert so.scheduled_spec_decode_tokens == {"a": [9], "c": [9, 7, 8, 9]}
    outs = {o.req_id: o for o in run(sched, so, {"a": [9, 4], "b": [1],
                                                 "c": [9, 7, 8, 9, 7]})}
    assert outs["a"].new_token_ids == [9, 4] and outs["a"].finish_reason == "length"
    assert outs["c"].new_token_ids == [9, 7] and outs["c"].stop_reason == 7
    assert set(sched.requests) == {"b"} and kv.get_block_ids("c") == []


def test_preemption_drops_the_drafts():
    sched, kv, spec = make(num_blocks=5, budget=16, max_model_len=16)  # 4 usable blocks
    sched.add_request(request("a"))
    sched.add_request(request("b", prompt=[4, 5, 6, 4, 5, 6, 4]))
    run(sched, sched.schedule(), {"a": [8], "b": [5]})  # 8 tokens each: 2 blocks each
    so = sched.schedule()  # a's 5 tokens need a third block: b is preempted
    assert so.preempted_req_ids == {"b"}
    assert so.scheduled_spec_decode_tokens == {"a": [9, 7, 8, 9]}
    assert sched.requests["b"].num_computed_tokens == 0


def test_the_stats_line_shows_acceptance_over_the_interval(caplog):
    import logging

    from jaxllm.engine.metrics import SchedulerStats
    from jaxllm.engine.stat_logger import LoggingStatLogger
    from jaxllm.spec_decode.scheduling import SpecDecodingStats

    now = [0.0]
    stat_logger = LoggingStatLogger(interval=10, clock=lambda: now[0])
    first = SpecDecodingStats(4, 16, 8, (4, 2, 1, 1))
    second = SpecDecodingStats(14, 56, 38, (14, 10, 8, 6))  # +10 drafts, +40, +30
    with caplog.at_level(logging.INFO, logger="jaxllm.engine.stat_logger"):
        now[0] = 10
        stat_logger.log(SchedulerStats(spec_decoding=first))
        now[0] = 20
        stat_logger.log(SchedulerStats(spec_decoding=second))
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert lines[0] == ("SpecDecoding metrics: Mean acceptance length: 3.00, Accepted: 8 "
                        "tokens, Drafted: 16 tokens, Per-position acceptance rate: 1.000, "
                        "0.500, 0.250, 0.250, Avg Draft acceptance rate: 50.0%")
    assert lines[1] == ("SpecDecoding metrics: Mean acceptance length: 4.00, Accepted: 30 "
                        "tokens, Drafted: 40 tokens, Per-position acceptance rate: 1.000, "
                        "0.800, 0.700, 0.500, Avg Draft acceptance rate: 75.0%")
    assert second.mean_acceptance_length == 1 + 38 / 14
