"""Scheduling must never change what is generated: preemption and chunked prefill, end to end.

Each test runs the same requests twice, once where the scheduler has room and once where it
must preempt (a KV cache of ~1.5 sequences at max length) or chunk (a prompt longer than the
token budget), and asks for the same tokens (greedy, and seeded random sampling) and the
same prompt logprobs. Tiny random model; the real-model preemption test is in
test_e2e_real_model.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import SamplingParams

from tiny_model import greedy, metric_values, token_ids

VOCAB = 49152
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
# The tight engine: 1.5 sequences of its max_model_len, plus the null block.
TIGHT_MAX_MODEL_LEN = 128
TIGHT_BLOCKS = 1 + (3 * TIGHT_MAX_MODEL_LEN // BLOCK_SIZE) // 2


def random_prompts(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def _prompt_logprob_values(output) -> list[float]:
    """The actual prompt token's logprob at each position after the first."""
    return [entry[token].logprob
            for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]


@pytest.fixture(scope="module")
def tight_llm(make_tiny_llm):
    return make_tiny_llm(max_model_len=TIGHT_MAX_MODEL_LEN,
                         num_gpu_blocks_override=TIGHT_BLOCKS)


def test_preemption_gives_the_same_tokens(tiny_llm, tight_llm):
    # Four requests of 86..124 tokens (6..8 blocks each, 27 in all) against 12 usable blocks.
    prompts = random_prompts([30, 45, 22, 60], seed=1)
    params = [greedy(64), greedy(64, prompt_logprobs=1),
              SamplingParams(temperature=1.0, seed=7, max_tokens=64, ignore_eos=True),
              greedy(64, logprobs=2)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    before = metric_values(tiny_llm)["jaxllm:num_preemptions_total"]
    roomy = tiny_llm.generate(requests, params, use_tqdm=False)
    assert metric_values(tiny_llm)["jaxllm:num_preemptions_total"] == before

    tight = tight_llm.generate(requests, params, use_tqdm=False)
    metrics = metric_values(tight_llm)
    assert metrics["jaxllm:num_preemptions_total"] > 0
    assert token_ids(tight) == token_ids(roomy)
    assert all(len(t) == 64 for t in token_ids(tight))
    # Prompt logprobs are recomputed after a preemption: each position is reported once.
    assert len(tight[1].prompt_logprobs) == len(prompts[1])
    np.testing.assert_allclose(_prompt_logprob_values(tight[1]),
                               _prompt_logprob_values(roomy[1]), rtol=0, atol=1e-4)
    assert len(tight[3].outputs[0].logprobs) == 64
    # Everything is given back at the end.
    assert metrics["jaxllm:kv_cache_usage_perc"] == 0.0
    assert tight_llm.llm_engine.kv_cache_manager.num_free_blocks == TIGHT_BLOCKS - 1


def test_chunked_prefill_gives_the_same_tokens(tiny_llm, make_tiny_llm):
    """A 150-token prompt against a 64-token budget (three chunks, sharing the budget with a
    short request) equals one 150-token prefill under a 256-token budget."""
    prompts = random_prompts([150, 12], seed=2)
    params = [greedy(16, prompt_logprobs=2), greedy(16)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    chunked = tiny_llm.generate(requests, params, use_tqdm=False)
    big_budget = make_tiny_llm(max_num_batched_tokens=256)
    whole = big_budget.generate(requests, params, use_tqdm=False)

    assert token_ids(chunked) == token_ids(whole)
    assert len(chunked[0].prompt_logprobs) == 150
    np.testing.assert_allclose(_prompt_logprob_values(chunked[0]),
                               _prompt_logprob_values(whole[0]), rtol=0, atol=1e-4)


def test_prompt_of_max_model_len_gets_one_token(tiny_llm):
    """The context is full after the prompt: one token is sampled, then "length"."""
    out, = tiny_llm.generate({"prompt_token_ids": random_prompts([MAX_MODEL_LEN], seed=3)[0]},
                             greedy(10), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"
