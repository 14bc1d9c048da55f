"""Prefix caching never changes what is generated, end to end on the tiny model.

The same requests run on engines with caching on and off, and must give the same greedy
tokens: under preemption (a KV cache of 17 usable blocks) and chunked prefill (a budget of
32 tokens), with a prefix shared inside one step, with a cache that has evicted and
refilled, in async and sync scheduling, and with penalties (which read the device token
history that a cache hit never wrote). `n = 4` children compute their prompt about once.
A warm engine serves cache hits without compiling.
"""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pytest
from jax import monitoring

from jaxllm import SamplingParams
from jaxllm.engine.block_hash import hash_prefix

from tiny_model import greedy, metric_values, token_ids

VOCAB = 49152
BLOCK_SIZE = 16
# 17 usable blocks of 16 (the null block aside); one max-length request needs 14.
TIGHT = dict(max_model_len=224, num_gpu_blocks_override=18, max_num_batched_tokens=32,
             max_num_seqs=4)
QUERIES, HITS = "jaxllm:prefix_cache_queries", "jaxllm:prefix_cache_hits"


def random_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def shared_prefix_prompts(prefix_len: int, suffix_lens, seed: int) -> list[dict]:
    prefix = random_tokens(prefix_len, seed)
    return [{"prompt_token_ids": prefix + random_tokens(n, seed + 1 + i)}
            for i, n in enumerate(suffix_lens)]


def cache_counters(llm) -> tuple[float, float]:
    m = metric_values(llm)
    return m[QUERIES], m[HITS]


@pytest.fixture(scope="module")
def on_llm(make_tiny_llm):
    return make_tiny_llm(**TIGHT)


@pytest.fixture(scope="module")
def off_llm(make_tiny_llm):
    return make_tiny_llm(**TIGHT, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def on_sync_llm(make_tiny_llm):
    return make_tiny_llm(**TIGHT, async_scheduling=False)


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("engine", ["on_llm", "on_sync_llm"])
def test_preemption_chunking_and_in_step_sharing_give_the_same_tokens(engine, request,
                                                                      off_llm):
    llm = request.getfixturevalue(engine)
    # Six requests share a 50-token prefix (3 full blocks); 4 run at once and need ~7 blocks
    # each: preemption is certain, every prompt is chunked, and the requests admitted in
    # one step share the prefix the first of them is computing.
    prompts = shared_prefix_prompts(50, [5, 20, 13, 30, 9, 24], seed=1)
    params = greedy(48)
    before_q, before_h = cache_counters(llm)
    preemptions = metric_values(llm)["jaxllm:num_preemptions_total"]
    outputs = run(llm, prompts, params)
    assert token_ids(outputs) == token_ids(run(off_llm, prompts, params))
    assert metric_values(llm)["jaxllm:num_preemptions_total"] > preemptions
    queries, hits = cache_counters(llm)
    assert hits - before_h >= 5 * 48  # the five later requests hit the 3 prefix blocks
    assert queries - before_q >= sum(len(p["prompt_token_ids"]) for p in prompts)
    assert all(o.num_cached_tokens % BLOCK_SIZE == 0 for o in outputs)
    assert sum(o.num_cached_tokens >= 48 for o in outputs) >= 5
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1  # everything released, cache kept
    assert kv.block_pool.cached_block_hash_to_block


def test_evicted_and_refilled_cache_gives_the_same_tokens(on_llm, off_llm):
    prompts = shared_prefix_prompts(40, [3, 17, 8], seed=11)
    params = greedy(24)
    expected = token_ids(run(off_llm, prompts, params))
    assert token_ids(run(on_llm, prompts, params)) == expected
    kv = on_llm.llm_engine.kv_cache_manager
    prefix_hashes = hash_prefix(prompts[0]["prompt_token_ids"], BLOCK_SIZE)
    assert prefix_hashes[0] in kv.block_pool.cached_block_hash_to_block
    # Unrelated traffic (more than the 17 blocks) evicts the whole cached prefix ...
    run(on_llm, [{"prompt_token_ids": random_tokens(120, 100 + i)} for i in range(3)],
        greedy(40))
    assert prefix_hashes[0] not in kv.block_pool.cached_block_hash_to_block
    # ... and the same requests refill it, with hits again among themselves.
    _, before_h = cache_counters(on_llm)
    assert token_ids(run(on_llm, prompts, params)) == expected
    assert cache_counters(on_llm)[1] - before_h >= 2 * 32


def test_a_second_run_of_a_prompt_hits_and_matches(on_llm, off_llm):
    prompt = [{"prompt_token_ids": random_tokens(70, 21)}]  # 4 full blocks + 6
    params = greedy(16)
    expected = token_ids(run(off_llm, prompt, params))
    (first,) = run(on_llm, prompt, params)
    (second,) = run(on_llm, prompt, params)
    assert token_ids([first]) == token_ids([second]) == expected
    assert second.num_cached_tokens == 64
    # Prompt logprobs skip the cache: every position is computed and scored.
    q0, h0 = cache_counters(on_llm)
    (scored,) = run(on_llm, prompt, greedy(16, prompt_logprobs=1))
    assert cache_counters(on_llm) == (q0, h0)
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == 70
    assert token_ids([scored]) == expected
    # reset_prefix_cache forgets it: the next run computes the prompt again.
    assert on_llm.reset_prefix_cache() is True
    (third,) = run(on_llm, prompt, params)
    assert third.num_cached_tokens == 0 and token_ids([third]) == expected


def test_parallel_sampling_computes_the_prompt_about_once(on_llm, off_llm):
    prompt = [{"prompt_token_ids": random_tokens(200, 31)}]
    params = SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    q0, h0 = cache_counters(on_llm)
    (out,) = run(on_llm, prompt, params)
    queries, hits = cache_counters(on_llm)
    computed = (queries - q0) - (hits - h0)
    # Child 0 prefills 200 tokens; the others hit its 12 full blocks and compute only the
    # last 8 prompt tokens each (the partial block): 200 + 3 * 8.
    assert (queries - q0, hits - h0, computed) == (4 * 200, 3 * 192, 224)
    assert len(out.outputs) == 4
    ref = [list(c.token_ids) for c in run(off_llm, prompt, params)[0].outputs]
    assert [list(c.token_ids) for c in out.outputs] == ref


@contextlib.contextmanager
def jax_compile_events():
    """Counter of JAX's compile-pipeline events (trace, lower, compile) inside the block."""
    events: collections.Counter[str] = collections.Counter()

    def listener(event: str, duration: float, **kwargs) -> None:
        if event.startswith("/jax/core/compile/"):
            events[event] += 1

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(listener)


def test_penalties_read_the_uploaded_history_and_warm_hits_never_compile(make_tiny_llm,
                                                                         off_llm):
    """Positions a cache hit skips are never run by the request, so the step never writes
    them into its device token history; the runner uploads them when the request joins.
    Repetition penalties read prompt tokens there: without the upload they would differ."""
    warm = make_tiny_llm(**TIGHT, enforce_eager=False)
    # The shared prefix is the model's own greedy continuation of 8 tokens, so the tokens
    # it would pick next are in the prompt, where only the repetition penalty sees them.
    base = random_tokens(8, 41)
    prefix = base + token_ids(run(off_llm, [{"prompt_token_ids": base}], greedy(56)))[0]
    prompts = [{"prompt_token_ids": prefix + random_tokens(n, 42 + n)} for n in (2, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.5)] * 2
    expected = token_ids(run(off_llm, prompts, params))
    # The second request of each run hits the 64-token prefix the first one computes.
    with jax_compile_events() as events:
        first = run(warm, prompts, params)
        again = run(warm, prompts, params)  # both hit now
    assert not events, f"JAX compiled while serving: {dict(events)}"
    assert [o.num_cached_tokens for o in first] == [0, 64]
    assert [o.num_cached_tokens for o in again] == [64, 64]
    assert token_ids(first) == token_ids(again) == expected


def test_a_continued_conversation_reuses_the_finished_tail(on_llm, off_llm):
    """Turn 2 = turn 1's prompt + its output + new tokens (a multi-turn chat): the full
    blocks hit, the partial block turn 1 left is copied, and only the new tokens compute."""
    first_prompt = random_tokens(37, 31)
    (first,) = run(on_llm, [{"prompt_token_ids": first_prompt}], greedy(6))
    computed = first_prompt + list(first.outputs[0].token_ids[:-1])  # the last is not computed
    second = [{"prompt_token_ids": first_prompt + list(first.outputs[0].token_ids)
               + random_tokens(5, 32)}]
    expected = token_ids(run(off_llm, second, greedy(12)))
    (out,) = run(on_llm, second, greedy(12))
    assert token_ids([out]) == expected
    assert out.num_cached_tokens == len(computed)
