"""Exact tests of automatic prefix caching: block ids, ref counts, eviction order, hashes.

Block size 4 throughout. Prompts are built from named segments so that sharing is visible:
P8 = two full blocks, and a request with prompt P8 + [x, y] has blocks [full, full, partial].
"""

import functools

import pytest

from jaxllm.engine.block_hash import ROOT_HASH, hash_block_tokens, hash_prefix
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import Scheduler
from jaxllm.messages import ModelRunnerOutput
from jaxllm.sampling_params import SamplingParams

EOS = 2
BS = 4
Params = functools.partial(SamplingParams, max_tokens=16, ignore_eos=True)
P8 = [100, 101, 102, 103, 104, 105, 106, 107]  # two full blocks


def make_scheduler(*, num_blocks=16, max_model_len=32, max_num_seqs=8,
                   max_num_batched_tokens=64, enable_caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, max_model_len, enable_caching=enable_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len)


def make_request(req_id: str, prompt: list[int], **params) -> Request:
    return Request(req_id, prompt, Params(**params), eos_token_id=EOS, arrival_time=0.0)


def runner_output(sched, out, token=7) -> ModelRunnerOutput:
    """Samples `token` for every scheduled request whose prefill is complete."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = sched.requests.get(req_id)
        complete = req is None or req.num_computed_tokens >= req.num_tokens
        sampled.append([token] if complete else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def step(sched, token=7):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner_output(sched, out, token))


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(sched) -> list[int]:
    return ids(sched.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks())


def ref_cnts(sched, *block_ids) -> list[int]:
    blocks = sched.kv_cache_manager.block_pool.blocks
    return [blocks[i].ref_cnt for i in block_ids]


def tail_ids(sched) -> list[int]:
    return sorted(b.block_id for b in
                  sched.kv_cache_manager.block_pool.cached_tail_to_block.values())


def cached_ids(sched) -> list[int]:
    return sorted(b.block_id for b in
                  sched.kv_cache_manager.block_pool.cached_block_hash_to_block.values())


# -- hashes -------------------------------------------------------------------------------
def test_block_hashes_are_chained_sha256_of_full_blocks_only():
    h = hash_prefix(P8 + [1, 2, 3], BS)
    assert len(h) == 2  # the partial block has no hash
    assert h[0] == hash_block_tokens(ROOT_HASH, P8[:4])
    assert h[1] == hash_block_tokens(h[0], P8[4:])
    assert all(isinstance(x, bytes) and len(x) == 32 for x in h)
    # The same tokens under another parent are another block.
    assert hash_block_tokens(ROOT_HASH, P8[4:]) != h[1]
    # Extra keys (a LoRA id, a cache salt, later) separate otherwise equal blocks.
    assert hash_block_tokens(ROOT_HASH, P8[:4], ("salt",)) != h[0]
    # Stable across processes and runs (sha256, not Python's salted hash()): pinned.
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]).hex()[:16] == "fd18cf5a07d28943"
    assert hash_prefix([1, 2, 3, 4], 2) == [hash_block_tokens(ROOT_HASH, [1, 2]),
                                            hash_block_tokens(hash_block_tokens(
                                                ROOT_HASH, [1, 2]), [3, 4])]


def test_request_hashes_prompt_on_arrival_and_output_blocks_as_they_fill():
    sched = make_scheduler()
    a = make_request("a", P8[:6])
    sched.add_request(a)
    assert a.block_hashes == hash_prefix(P8[:4], BS)
    step(sched, token=50)  # prefill; samples 50 at position 6
    assert len(a.block_hashes) == 1 and cached_ids(sched) == [1]
    step(sched, token=51)  # computes position 6, samples 51 at position 7
    # Tokens 4..7 are known: block 1 has a hash, but position 7 is not computed yet.
    assert a.block_hashes == hash_prefix(P8[:6] + [50, 51], BS)
    assert cached_ids(sched) == [1]
    out, _ = step(sched, token=52)  # position 7 scheduled: block 2 completes
    assert out.num_scheduled_tokens == {"a": 1}
    assert cached_ids(sched) == [1, 2]
    assert sched.kv_cache_manager.block_pool.blocks[2].block_hash == a.block_hashes[1]


def test_async_output_blocks_are_hashed_only_once_their_tokens_arrive():
    sched = make_scheduler()
    a = make_request("a", P8[:7])
    sched.add_request(a)
    out1 = sched.schedule()  # prefill 0..6, samples position 7 (a placeholder)
    out2 = sched.schedule()  # computes position 7 from the device, before its id is known
    assert out2.num_scheduled_tokens == {"a": 1}
    assert a.num_computed_tokens == 8 and a.num_output_placeholders == 2
    assert len(a.block_hashes) == 1 and cached_ids(sched) == [1]  # block 2 awaits a token
    sched.update_from_output(out1, runner_output(sched, out1, token=60))
    # Position 7's id arrived and its K/V is scheduled: block 2 joins the cache now.
    assert a.block_hashes == hash_prefix(P8[:7] + [60], BS)
    assert cached_ids(sched) == [1, 2]
    sched.update_from_output(out2, ModelRunnerOutput(["a"], [[61]]))
    assert len(a.block_hashes) == 2


# -- hits ---------------------------------------------------------------------------------
def test_hit_on_full_blocks_only_and_partial_last_block_is_recomputed():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1, 2]))
    out, _ = step(sched)
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2, 3]
    assert cached_ids(sched) == [1, 2]  # block 3 holds 2 tokens: never cached
    sched.add_request(make_request("b", P8 + [1, 2, 9]))
    out, outs = step(sched)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("b", [1, 2, 4], 8)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert ref_cnts(sched, 1, 2, 3, 4) == [2, 2, 1, 1]
    (o,) = [o for o in outs if o.req_id == "b"]
    assert o.num_cached_tokens == 8
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)


def test_a_finished_requests_tail_is_copied_into_a_request_that_continues_it():
    """a (10 tokens, max_tokens=1) ends with blocks [1, 2] full and block 3 holding 2
    computed tokens: block 3 becomes a cached tail. b = a's tokens + its sample + 1 more:
    hits 1, 2, gets a fresh block (4) with a copy of 3, and computes its last 2 tokens."""
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1, 2], max_tokens=1))
    step(sched)  # a samples 7 and finishes
    assert tail_ids(sched) == [3] and cached_ids(sched) == [1, 2]
    sched.add_request(make_request("b", P8 + [1, 2, 7, 9]))
    out, outs = step(sched)
    (new,) = out.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens) == ([1, 2, 4], 10)
    assert out.blocks_to_copy == [(3, 4)] and out.num_scheduled_tokens == {"b": 2}
    assert outs[0].num_cached_tokens == 10
    assert ref_cnts(sched, 1, 2, 3, 4) == [1, 1, 0, 1]
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 12, 10)
    # The next schedule copies nothing more.
    out, _ = step(sched)
    assert out.blocks_to_copy == []


def test_a_tail_hit_is_the_longest_cached_tail_and_never_the_last_token():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1, 2], max_tokens=1))  # tail [1, 2]
    step(sched)
    sched.add_request(make_request("b", P8 + [1, 2]))  # the same 10: only [1] may hit
    out, _ = step(sched)
    (new,) = out.scheduled_new_reqs
    # [1] alone is not a cached tail ([1, 2] is): the hit stays at the 8 full-block tokens.
    assert (new.num_computed_tokens, out.blocks_to_copy) == (8, [])
    sched.add_request(make_request("c", P8 + [1, 3, 5]))  # diverges inside the tail
    out, _ = step(sched)
    (new,) = out.scheduled_new_reqs
    assert (new.num_computed_tokens, out.blocks_to_copy) == (8, [])


def test_an_aborted_request_leaves_no_tail():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1, 2], max_tokens=4))
    step(sched)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert tail_ids(sched) == [] and cached_ids(sched) == [1, 2]


def test_full_hit_is_capped_so_the_last_token_is_computed():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8))
    step(sched)
    assert cached_ids(sched) == [1, 2]
    sched.add_request(make_request("b", P8))
    out, _ = step(sched)
    # 8 tokens cached, but a hit stops at 7 and whole blocks only: 4 tokens, block 1.
    (new,) = out.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens) == ([1, 4], 4)
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    # b recomputed the last block: a duplicate of block 2, kept out of the index.
    assert cached_ids(sched) == [1, 2]
    assert sched.kv_cache_manager.block_pool.blocks[4].block_hash is None
    assert sched.requests["b"].block_hashes[1] == sched.requests["a"].block_hashes[1]


def test_one_token_prompt_never_hits():
    sched = make_scheduler()
    blocks, n = sched.kv_cache_manager.get_computed_blocks(make_request("a", [5]))
    assert (blocks, n) == ([], 0)


def test_prefix_shared_within_one_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1]))
    sched.add_request(make_request("b", P8 + [2, 3]))
    out = sched.schedule()
    # a's blocks are offered to the cache when scheduled, so b, admitted after a in the
    # same step, already shares them.
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs] \
        == [("a", [1, 2, 3], 0), ("b", [1, 2, 4], 8)]
    assert out.num_scheduled_tokens == {"a": 9, "b": 2}
    assert ref_cnts(sched, 1, 2, 3, 4) == [2, 2, 1, 1]


def test_chunked_prefill_shares_only_what_is_scheduled():
    sched = make_scheduler(max_num_batched_tokens=6)
    sched.add_request(make_request("a", P8 + P8))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6}
    assert cached_ids(sched) == [1]  # positions 0..5: only block 1 is full
    sched.update_from_output(out, runner_output(sched, out))
    sched.add_request(make_request("b", P8 + [9]))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6}  # the budget is spent on a
    assert cached_ids(sched) == [1, 2, 3]
    sched.update_from_output(out, runner_output(sched, out))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 1}
    (new,) = out.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens) == ([1, 2, 5], 8)


def test_parallel_sampling_children_share_the_prompt():
    sched = make_scheduler()
    prompt = P8 + P8 + [1, 2]  # 18 tokens: 4 full blocks
    for i in range(4):
        sched.add_request(make_request(f"{i}_p", prompt, max_tokens=2))
    out, outs = step(sched)
    assert out.num_scheduled_tokens == {"0_p": 18, "1_p": 2, "2_p": 2, "3_p": 2}
    assert [r.block_ids for r in out.scheduled_new_reqs] == [
        [1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7], [1, 2, 3, 4, 8]]
    assert ref_cnts(sched, 1, 2, 3, 4, 5, 6) == [4, 4, 4, 4, 1, 1]
    assert [o.num_cached_tokens for o in outs] == [0, 16, 16, 16]
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 * 18, 3 * 16)
    step(sched)  # max_tokens=2: all finish
    assert not sched.requests and ref_cnts(sched, 1, 2, 3, 4) == [0, 0, 0, 0]


def test_prompt_logprobs_requests_skip_the_lookup_but_fill_the_cache():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1]))
    step(sched)
    sched.add_request(make_request("b", P8 + [1], prompt_logprobs=1))
    out, _ = step(sched)
    (new,) = out.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens) == ([4, 5, 6], 0)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert ref_cnts(sched, 1, 2) == [1, 1]
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9, 0)  # b not counted


def test_caching_off_never_hashes_or_hits():
    sched = make_scheduler(enable_caching=False)
    a = make_request("a", P8 + [1])
    sched.add_request(a)
    step(sched)
    sched.add_request(make_request("b", P8 + [1]))
    out, _ = step(sched)
    assert out.scheduled_new_reqs[0].block_ids == [4, 5, 6]
    assert a.block_hashes == [] and cached_ids(sched) == []
    assert sched.make_stats().prefix_cache_queries == 0


# -- references, eviction -----------------------------------------------------------------
def test_freed_blocks_stay_cached_and_are_rehit_out_of_the_middle_of_the_queue():
    sched = make_scheduler(num_blocks=8, max_model_len=16)
    sched.add_request(make_request("a", P8 + [1], max_tokens=1))
    step(sched)  # a finishes
    assert not sched.requests
    # Freed tail first: 3 (partial, uncached), then 2, then 1, behind the untouched 4..7.
    assert free_ids(sched) == [4, 5, 6, 7, 3, 2, 1]
    assert cached_ids(sched) == [1, 2]
    sched.add_request(make_request("b", P8 + [2, 3]))
    out, _ = step(sched)
    # Hits 1 and 2 leave the queue from its middle and end; the fresh block is its front.
    assert out.scheduled_new_reqs[0].block_ids == [1, 2, 4]
    assert free_ids(sched) == [5, 6, 7, 3]
    assert ref_cnts(sched, 1, 2, 4) == [1, 1, 1]


def test_eviction_is_lru_and_tail_first():
    sched = make_scheduler(num_blocks=7, max_model_len=24)  # 6 usable blocks
    sched.add_request(make_request("a", P8 + P8[:4] + [1], max_tokens=1))  # 3 full + partial
    step(sched)
    assert free_ids(sched) == [5, 6, 4, 3, 2, 1]
    assert cached_ids(sched) == [1, 2, 3]
    assert tail_ids(sched) == [4]  # a's partial block, cached as a tail when a finished
    # An unrelated 13-token prompt needs 4 blocks: 5, 6, then a's tail (4) and a's last full
    # block (3), both evicted; a's prefix (1, 2) survives.
    sched.add_request(make_request("b", [200 + i for i in range(13)], max_tokens=1))
    out, _ = step(sched)
    assert out.scheduled_new_reqs[0].block_ids == [5, 6, 4, 3]
    assert tail_ids(sched) == [3]  # b's partial block, a tail now that b finished
    assert cached_ids(sched) == [1, 2, 4, 5, 6]  # 4 now caches b's third block
    sched.add_request(make_request("c", P8 + P8[:4] + [9]))
    out, _ = step(sched)
    (new,) = out.scheduled_new_reqs
    assert (new.block_ids[:2], new.num_computed_tokens) == ([1, 2], 8)


def test_hits_in_the_free_queue_count_against_free_blocks():
    sched = make_scheduler(num_blocks=5, max_model_len=16)  # 4 usable blocks
    sched.add_request(make_request("a", P8 + [1], max_tokens=1))
    step(sched)
    sched.add_request(make_request("x", [300, 301, 302, 303, 304], max_tokens=3))
    step(sched)  # x holds 2 blocks; free: a's 1, 2 (cached)
    assert sched.kv_cache_manager.num_free_blocks == 2
    # b hits 1, 2 (both free) and needs 1 more: 3 > 2 free, so it waits, nothing changed.
    sched.add_request(make_request("b", P8 + [5, 6]))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"x": 1}
    assert ref_cnts(sched, 1, 2) == [0, 0] and cached_ids(sched) == [1, 2, 4]  # 4: x's
    assert sched.make_stats().prefix_cache_queries == 9 + 5  # b not admitted: not counted
    step(sched)
    out, _ = step(sched)  # x done after its 3rd token; b fits now
    assert out.scheduled_new_reqs[0].block_ids[:2] == [1, 2]


def test_preemption_and_abort_release_references_never_blocks_of_others():
    sched = make_scheduler(num_blocks=5, max_model_len=16)  # 4 usable blocks
    sched.add_request(make_request("a", P8 + [1]))
    sched.add_request(make_request("b", P8 + [2]))
    step(sched)
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2, 3]
    assert sched.kv_cache_manager.get_block_ids("b") == [1, 2, 4]
    assert ref_cnts(sched, 1, 2, 3, 4) == [2, 2, 1, 1] and free_ids(sched) == []
    for _ in range(3):  # both decode positions 9..11 in their own third blocks
        out, _ = step(sched)
    assert cached_ids(sched) == [1, 2, 3, 4]  # positions 8..11 of each: full and computed
    out, _ = step(sched)  # a needs a 5th block for position 12: b, the tail, is preempted
    assert (out.preempted_req_ids, out.num_scheduled_tokens) == ({"b"}, {"a": 1})
    # b gave back one reference to 1 and 2 (a still holds them) and its own block 4,
    # which a took at once as a fresh block (evicting b's cached positions 8..11).
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 2, 3, 4]
    assert ref_cnts(sched, 1, 2, 3, 4) == [1, 1, 1, 1] and free_ids(sched) == []
    assert cached_ids(sched) == [1, 2, 3]

    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert ref_cnts(sched, 1, 2, 3, 4) == [0, 0, 0, 0]
    assert free_ids(sched) == [4, 3, 2, 1]  # a's tail first
    out, _ = step(sched)
    # b (13 tokens) resumes through the cache: its prompt blocks hit, its first output block
    # was evicted; its two fresh blocks come from the queue's front (3 is evicted).
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("b", [1, 2, 4, 3], 8)
    assert out.num_scheduled_tokens == {"b": 5}
    assert cached_ids(sched) == [1, 2, 4]


def test_preempted_request_resumes_through_the_cache():
    sched = make_scheduler(num_blocks=6, max_model_len=16)  # 5 usable blocks
    sched.add_request(make_request("a", P8 + [1]))  # 3 blocks
    step(sched)
    sched.add_request(make_request("b", [200 + i for i in range(7)]))
    step(sched)  # b holds 2 blocks: none free
    assert sched.kv_cache_manager.num_free_blocks == 0
    step(sched)  # a decodes position 10, b position 7 (filling its second block)
    out, _ = step(sched)  # b needs a third block for position 8: it preempts itself
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    b = sched.requests["b"]
    assert b.num_tokens == 9
    assert b.block_hashes == hash_prefix(b.prompt_token_ids + b.output_token_ids, BS)
    assert free_ids(sched) == [5, 4] and cached_ids(sched) == [1, 2, 3, 4, 5]
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    (new,) = out.scheduled_new_reqs
    # Both of b's blocks were cached (prompt, and prompt + first output): 8 of 9 tokens.
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("b", [4, 5, 3], 8)
    assert out.num_scheduled_tokens == {"b": 1}
    assert b.num_cached_tokens == 0  # set on first schedule only
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9 + 7 + 9, 8)


# -- surface ------------------------------------------------------------------------------
def test_reset_prefix_cache_refused_while_blocks_are_held():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1], max_tokens=2))
    step(sched)
    assert sched.reset_prefix_cache() is False
    assert cached_ids(sched) == [1, 2]
    step(sched)  # a finishes
    assert sched.reset_prefix_cache() is True
    assert cached_ids(sched) == []
    assert all(b.block_hash is None for b in sched.kv_cache_manager.block_pool.blocks)
    sched.add_request(make_request("b", P8 + [1]))
    out, _ = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_a_failed_step_takes_its_blocks_out_of_the_cache():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1]))
    sched.schedule()  # offered blocks 1, 2 ... and then the step raises
    outs = sched.fail_requests(["a"])
    assert [o.finish_reason for o in outs] == ["error"]
    assert cached_ids(sched) == [] and ref_cnts(sched, 1, 2, 3) == [0, 0, 0]
    sched.add_request(make_request("b", P8 + [1]))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_preempt_all_forgets_the_cache():
    sched = make_scheduler()
    sched.add_request(make_request("a", P8 + [1]))
    step(sched)
    sched.preempt_all()  # the device lost its KV cache
    assert cached_ids(sched) == []
    out = sched.schedule()
    assert out.preempted_req_ids == {"a"}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


@pytest.mark.parametrize("bad", [0, 1, "yes", None])
def test_config_field_is_a_bool(bad):
    from jaxllm.config import EngineConfig
    assert EngineConfig().enable_prefix_caching is True  # vLLM v1's default
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        EngineConfig(enable_prefix_caching=bad)
