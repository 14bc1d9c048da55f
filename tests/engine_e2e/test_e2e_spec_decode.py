"""Speculative decoding end to end (jaxllm/spec_decode/): n-gram drafts verified inside the
unified step, on a tiny random Llama with a 64-token vocabulary (its greedy outputs fall into
loops, so prompt lookup finds drafts that are accepted). One warmed speculative engine; the
reference is HF transformers' float32 forward of the same weights (no second engine: its
buckets would cost as much again to compile).

  * greedy outputs equal HF's greedy tokens (as speculation off does), with drafts
    accepted (count > 0), and max_tokens that end a request inside a verified run;
  * stop strings, stop ids and min_tokens cut the output where the plain rules say;
  * serving after warm-up compiles nothing (STYLE habit 9), every sampling kind mixed in;
  * random sampling: the token sampled at a verified position follows HF's conditional
    distribution (chi-square over the samples), and seeded requests reproduce;
  * the spec_decode_* metrics count what the scheduler verified.
(With a grammar: test_e2e_spec_grammar.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jax.scipy.special import gammaincc

from jaxllm import LLM, SamplingParams
from test_e2e_warmup import jax_compile_events
from tiny_model import SMALL, TINY_CONFIG, build_tiny_hf_dir, greedy, hf_greedy, token_ids

# auto_disable off: the tests count drafts, which the measured cost model could switch off
# on a busy machine (tests/spec_decode/test_cost_model.py tests that model).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 1, "auto_disable": False}
# Every id of the vocabulary occurs in it, so the first output token always finds a match.
ALL_IDS = np.random.default_rng(0).permutation(64).tolist()
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6],
           list(range(10, 50)), ALL_IDS]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    path = str(tmp_path_factory.mktemp("tiny_v64"))
    hf = build_tiny_hf_dir(path, "LlamaConfig", "LlamaForCausalLM", tokenizer, 0,
                           **{**TINY_CONFIG, "vocab_size": 64})
    # Two token buckets (2, 4), the fewest compiles: a row verifies up to 3 drafts, and
    # when both rows decode the budget caps them at 1 draft each.
    llm = LLM(path, **{**SMALL, "enforce_eager": False, "max_num_seqs": 2,
                       "max_num_batched_tokens": 4, "max_model_len": 96},
              async_scheduling=False, speculative_config=SPEC)
    return llm, hf


def prompts(ids):
    return [{"prompt_token_ids": p} for p in ids]


def spec_stats(llm):
    return llm.llm_engine.scheduler.make_stats().spec_decoding


def test_greedy_outputs_as_without_speculation_and_drafts_accepted(engine):
    llm, hf = engine
    before = spec_stats(llm)
    lengths = [40, 13, 40, 7]
    got = token_ids(llm.generate(prompts(PROMPTS), [greedy(n) for n in lengths],
                                 use_tqdm=False))
    assert got == [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, lengths)]
    after = spec_stats(llm)
    assert after.num_accepted_tokens - before.num_accepted_tokens > 10
    assert after.num_draft_tokens > after.num_accepted_tokens


@torch.no_grad()
def test_logprobs_of_each_accepted_token(engine):
    llm, hf = engine
    before = spec_stats(llm).num_accepted_tokens
    params = [greedy(24, logprobs=2), greedy(24, logprobs=1, stop_token_ids=[30])]
    out = [o.outputs[0] for o in llm.generate(prompts(PROMPTS[:1]) * 2, params,
                                              use_tqdm=False)]
    assert spec_stats(llm).num_accepted_tokens > before
    ids = hf_greedy(hf, PROMPTS[0], 24)
    ref = torch.log_softmax(hf(torch.tensor([PROMPTS[0] + ids])).logits[0].double(), -1)
    for c, k in zip(out, (2, 1)):
        assert list(c.token_ids) == ids[:len(c.token_ids)]
        assert len(c.logprobs) == len(c.token_ids)  # a stop inside a run cuts the rows too
        for pos, (token, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(PROMPTS[0]) - 1 + pos]
            assert len(lp) == k + (token not in row.topk(k).indices.tolist())
            assert lp[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert lp[token].rank == 1
    assert out[1].finish_reason == "stop" and out[1].token_ids[-1] == 30


def test_stops_inside_an_accepted_run(engine):
    llm, _ = engine
    full = llm.generate(prompts(PROMPTS[:1]), greedy(40), use_tqdm=False)[0].outputs[0]
    ids = list(full.token_ids)
    # A stop id and a stop string from the middle of the (looping) output.
    stop_id = ids[20]
    stop_text = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id],
                             min_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text])]
    by_id, by_id_min, by_text = [o.outputs[0] for o in llm.generate(
        prompts(PROMPTS[:1]) * 3, params, use_tqdm=False)]
    first = ids.index(stop_id)
    assert (list(by_id.token_ids), by_id.finish_reason, by_id.stop_reason) == (
        ids[:first + 1], "stop", stop_id)
    # min_tokens masks the stop id in the sampler, which changes the greedy path: the
    # reference is the same request never speculated (asking for logprobs makes a request
    # ineligible; the tokens do not depend on it).
    plain = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id],
                           min_tokens=25, ignore_eos=True, logprobs=0)
    ref = llm.generate(prompts(PROMPTS[:1]), plain, use_tqdm=False)[0].outputs[0]
    assert list(by_id_min.token_ids) == list(ref.token_ids)
    assert len(ref.token_ids) >= 25
    assert (by_text.text, by_text.finish_reason, by_text.stop_reason) == (
        full.text[:full.text.index(stop_text)], "stop", stop_text)
    assert spec_stats(llm).num_accepted_tokens > 0


def test_serving_after_warmup_compiles_nothing(engine):
    spec, _ = engine
    runner = spec.llm_engine.runner
    compiled = runner.num_compiles
    params = [greedy(20), SamplingParams(temperature=1.0, seed=3, max_tokens=12),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=10, logprobs=2),
              SamplingParams(n=2, temperature=0.7, min_p=0.05, repetition_penalty=1.2,
                             max_tokens=9)]
    before = spec_stats(spec).num_drafts
    with jax_compile_events() as events:
        spec.generate(prompts(PROMPTS), params, use_tqdm=False)
    assert spec_stats(spec).num_drafts > before  # verification steps did run
    assert runner.num_compiles == compiled
    assert not events, f"JAX compiled while serving: {dict(events)}"


@torch.no_grad()
def test_sampled_tokens_keep_their_distribution(engine):
    """Output token 1 of ALL_IDS is sampled at a verified position (token 0 always finds a
    1-gram match); given each sample's token 0, it must follow HF's softmax there."""
    llm, hf = engine
    n = 192
    before = spec_stats(llm)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=3, ignore_eos=True)
    out = llm.generate(prompts(PROMPTS[3:]), params, use_tqdm=False)[0].outputs
    assert spec_stats(llm).num_drafts - before.num_drafts >= n
    first = np.array([c.token_ids[0] for c in out])
    second = np.array([c.token_ids[1] for c in out])
    firsts = np.unique(first)
    logits = hf(torch.tensor([ALL_IDS + [int(t)] for t in firsts])).logits[:, -1]
    probs = dict(zip(firsts.tolist(), torch.softmax(logits.double(), -1).numpy()))
    expected = sum(probs[int(t)] for t in first)  # [64], sums to n
    observed = np.bincount(second, minlength=64)
    keep = expected > 5  # pool the rare tokens into one cell
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert float(gammaincc((len(obs) - 1) / 2, stat / 2)) > 0.01

    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
    a = token_ids(llm.generate(prompts(PROMPTS[:2]), seeded, use_tqdm=False))
    assert a == token_ids(llm.generate(prompts(PROMPTS[:2]), seeded, use_tqdm=False))


def test_spec_decode_metrics(engine):
    spec, _ = engine
    stats = spec_stats(spec)
    values = {}
    for m in spec.get_metrics():
        if m.name.startswith("jaxllm:spec_decode"):
            values[(m.name, m.labels.get("position"))] = m.value
    assert values[("jaxllm:spec_decode_num_drafts", None)] == stats.num_drafts > 0
    assert values[("jaxllm:spec_decode_num_draft_tokens", None)] == stats.num_draft_tokens
    assert values[("jaxllm:spec_decode_num_accepted_tokens", None)] == \
        stats.num_accepted_tokens
    per_pos = [values[("jaxllm:spec_decode_num_accepted_tokens_per_pos", str(j))]
               for j in range(4)]
    assert per_pos == list(stats.num_accepted_tokens_per_pos)
    assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos)[::-1]

