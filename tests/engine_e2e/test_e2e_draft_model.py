"""Speculative decoding with a draft model (spec_decode/draft_model.py) end to end, on tiny
random Llamas with a 64-token vocabulary; the reference is HF transformers' float32 greedy
forward of the target.

  * the target as its own draft: greedy outputs equal HF's and every draft is accepted (the
    draft engine's prefill and decode rows give the target's verify rows the same bits);
  * another model as the draft (the target's weights plus noise): greedy outputs still equal
    HF's, with drafts accepted and rejected;
    seeded random sampling reproduces;
  * a draft whose vocabulary differs from the target's is a ValueError naming both.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from jaxllm import LLM, SamplingParams
from tiny_model import SMALL, TINY_CONFIG, build_tiny_hf_dir, greedy, hf_greedy, token_ids

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6],
           list(range(10, 40))]
LENGTHS = [30, 17, 24]
OPTIONS = {**SMALL, "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 96}
NOISE = 0.02


def spec(draft: str) -> dict:
    # auto_disable off: the tests count drafts, which the measured cost model could switch
    # off on a busy machine (tests/spec_decode/test_cost_model.py tests that model).
    return {"model": draft, "num_speculative_tokens": 3, "auto_disable": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    dirs, hf = {}, {}
    for name, seed, vocab in (("target", 0, 64), ("wide", 2, 80)):
        dirs[name] = str(tmp_path_factory.mktemp(f"draft_{name}"))
        hf[name] = build_tiny_hf_dir(dirs[name], "LlamaConfig", "LlamaForCausalLM", tokenizer,
                                     seed, **{**TINY_CONFIG, "vocab_size": vocab})
    # A draft that mostly agrees with the target: its weights plus noise.
    dirs["noisy"] = str(tmp_path_factory.mktemp("draft_noisy"))
    shutil.copytree(dirs["target"], dirs["noisy"], dirs_exist_ok=True)
    noisy = copy.deepcopy(hf["target"])
    torch.manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(NOISE * torch.randn_like(p))
    noisy.save_pretrained(dirs["noisy"])
    return dirs, hf


def generate(llm, params):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def stats(llm):
    return llm.llm_engine.scheduler.make_stats().spec_decoding


def test_the_target_as_its_own_draft_accepts_every_draft(models):
    dirs, hf = models
    llm = LLM(dirs["target"], **OPTIONS, speculative_config=spec(dirs["target"]))
    got = token_ids(generate(llm, [greedy(n) for n in LENGTHS]))
    assert got == [hf_greedy(hf["target"], p, n) for p, n in zip(PROMPTS, LENGTHS)]
    s = stats(llm)
    assert s.num_draft_tokens > 20 and s.num_accepted_tokens == s.num_draft_tokens
    llm.llm_engine.shutdown()


def test_another_draft_is_verified_and_seeded_sampling_reproduces(models):
    dirs, hf = models
    llm = LLM(dirs["target"], **OPTIONS, speculative_config=spec(dirs["noisy"]))
    got = token_ids(generate(llm, [greedy(n) for n in LENGTHS]))
    assert got == [hf_greedy(hf["target"], p, n) for p, n in zip(PROMPTS, LENGTHS)]
    s = stats(llm)
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    sampled = [SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)] * 3
    first = token_ids(generate(llm, sampled))
    assert token_ids(generate(llm, sampled)) == first
    llm.llm_engine.shutdown()


def test_a_draft_with_another_vocabulary_is_refused(models):
    dirs, _ = models
    with pytest.raises(ValueError, match=r"vocabulary of 80 tokens, the target 64"):
        LLM(dirs["target"], **OPTIONS, speculative_config=spec(dirs["wide"]))
