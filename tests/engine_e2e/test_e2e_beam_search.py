"""Beam search (jaxllm/beam_search.py): vLLM's API and ranking, checked against greedy
decoding, a teacher-forced rescoring, HF transformers' `num_beams` generate on the real model,
and the prefix cache (beams share blocks instead of re-prefilling).

Where HF's definition differs from vLLM's (which jaxllm follows):
  - a finished beam's score: vLLM divides the cumulative logprob by the length of prompt +
    generated tokens (less a final EOS) to the power length_penalty; HF by the generated
    length only;
  - stopping: vLLM runs max_tokens steps; HF (early_stopping=False) stops once no running beam
    can beat the finished ones;
  - EOS: vLLM keeps every EOS among a step's 2 * beam_width candidates as a finished beam; HF
    only those ranked within the first beam_width.
Without EOS (ours: ignore_eos=True; HF: eos_token_id=None) every beam has the same length and
both rank by cumulative logprob, so the beams must be the same; the HF test checks that case.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import BeamSearchParams, SamplingParams
from jaxllm.beam_search import beam_score

from tiny_model import greedy, token_ids


def random_prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def computed_prompt_tokens(llm) -> int:
    """Prompt tokens the engine computed: prompt tokens less prefix-cache hits."""
    s = llm.llm_engine.scheduler
    return s.num_prompt_tokens - s.prefix_cache_hits


def test_beam_width_1_is_greedy(tiny_llm):
    prompt = {"prompt_token_ids": random_prompt(40, 1)}
    expected = token_ids(tiny_llm.generate([prompt], greedy(12), use_tqdm=False))[0]
    (out,) = tiny_llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=12,
                                                             ignore_eos=True))
    (beam,) = out.sequences
    assert beam.tokens == prompt["prompt_token_ids"] + expected
    assert beam.finish_reason == "length"


def test_beams_are_sorted_and_cum_logprob_is_a_teacher_forced_rescoring(tiny_llm, tokenizer):
    prompts = [{"prompt_token_ids": random_prompt(30, 2)}, {"prompt_token_ids": random_prompt(21, 3)}]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outputs = tiny_llm.beam_search(prompts, params)
    eos = tokenizer.eos_token_id
    for prompt, out in zip(prompts, outputs):
        n = len(prompt["prompt_token_ids"])
        beams = out.sequences
        assert len(beams) == 3
        scores = [beam_score(b.tokens, b.cum_logprob, eos, 1.0) for b in beams]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(b.tokens) for b in beams}) == 3
        for beam in beams:
            assert beam.tokens[:n] == prompt["prompt_token_ids"] and len(beam.tokens) == n + 6
            # The same tokens scored in one pass: prompt logprobs of prompt + generated.
            (scored,) = tiny_llm.generate({"prompt_token_ids": beam.tokens},
                                          SamplingParams(max_tokens=1, prompt_logprobs=0),
                                          use_tqdm=False)
            rescored = sum(scored.prompt_logprobs[i][t].logprob
                           for i, t in enumerate(beam.tokens) if i >= n)
            assert beam.cum_logprob == pytest.approx(rescored, abs=1e-4)
            assert beam.text == tokenizer.decode(beam.tokens[n:], skip_special_tokens=True)


def test_generate_with_beam_search_params_returns_the_beams(tiny_llm):
    prompt = {"prompt_token_ids": random_prompt(25, 4)}
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    (beams,) = tiny_llm.beam_search([prompt], params)
    (out,) = tiny_llm.generate([prompt], params)
    assert out.prompt_token_ids == prompt["prompt_token_ids"] and out.finished
    assert [c.token_ids for c in out.outputs] == [b.tokens[25:] for b in beams.sequences]
    assert [c.cumulative_logprob for c in out.outputs] == [b.cum_logprob for b in
                                                            beams.sequences]


def test_bad_beam_search_params_raise_value_error(tiny_llm):
    for kwargs, name in [(dict(beam_width=0, max_tokens=4), "beam_width"),
                         (dict(beam_width=2, max_tokens=0), "max_tokens"),
                         (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
                         (dict(beam_width=2.5, max_tokens=4), "beam_width")]:
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="beam_width must be at most 10"):
        tiny_llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))


def test_beams_share_blocks_instead_of_reprefilling(make_tiny_llm):
    """A 4-beam search of 32 tokens on a 200-token prompt computes the prompt once, then one
    token per beam per step: each beam's full blocks are prefix-cache hits and its partial
    last block a cached tail copied into a fresh block. Without the cache every step
    prefills every beam (4 x 31 x ~216 tokens)."""
    llm = make_tiny_llm(max_model_len=512)
    prompt = {"prompt_token_ids": random_prompt(200, 5)}
    before = computed_prompt_tokens(llm)
    llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=32, ignore_eos=True))
    computed = computed_prompt_tokens(llm) - before
    assert computed == 200 + 4 * 31
    # ... and the same with the cache off recomputes every beam's whole sequence.
    off = make_tiny_llm(max_model_len=512, enable_prefix_caching=False)
    before = computed_prompt_tokens(off)
    off.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=32, ignore_eos=True))
    assert computed_prompt_tokens(off) - before > 4 * 31 * 200


@pytest.mark.slow
def test_beams_match_hf_num_beams_on_the_real_model(real_llm, hf_smollm2, tokenizer):
    import torch

    prompt = "The capital of France is"
    ids = tokenizer(prompt)["input_ids"]
    (ours,) = real_llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8,
                                                              ignore_eos=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            hf = hf_smollm2.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, num_beams=4, num_return_sequences=4, max_new_tokens=8,
                length_penalty=1.0, eos_token_id=None, pad_token_id=tokenizer.eos_token_id,
                output_scores=True, return_dict_in_generate=True)
    finally:
        torch.set_num_threads(threads)
    hf_beams = [seq[len(ids):].tolist() for seq in hf.sequences]
    assert all(len(b) == 8 for b in hf_beams)
    assert [b.tokens[len(ids):] for b in ours.sequences] == hf_beams
    # HF's sequence score is the cumulative logprob over the generated length.
    hf_cum = (hf.sequences_scores * 8).tolist()
    assert [b.cum_logprob for b in ours.sequences] == pytest.approx(hf_cum, abs=2e-3)
