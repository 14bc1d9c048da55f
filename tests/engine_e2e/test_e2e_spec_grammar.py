"""Speculative decoding under a grammar: n-gram drafts are cut to what the grammar accepts,
and the verify rows are masked by the grammar's state after each draft (SchedulerOutput.
grammar_bitmask [n, 1 + K, N]; runner/features/grammar.py mask_verify_rows), so greedy
tokens are HF's argmax over the allowed tokens, with drafts accepted. A tiny random Llama
with SmolLM2's whole vocabulary (llguidance needs it); the grammar allows digits only, and
the random model's digit choices fall into loops that prompt lookup drafts from.
"""

from __future__ import annotations

import pytest
import torch

from jaxllm import LLM, StructuredOutputsParams
from tiny_model import SMALL, TINY_CONFIG, build_tiny_hf_dir, greedy, token_ids

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
DIGITS = torch.arange(32, 42)  # "0".."9" in the SmolLM2 vocabulary
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "auto_disable": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    path = str(tmp_path_factory.mktemp("tiny_full_vocab"))
    hf = build_tiny_hf_dir(path, "LlamaConfig", "LlamaForCausalLM", tokenizer, 0,
                           **TINY_CONFIG)
    llm = LLM(path, **{**SMALL, "max_num_seqs": 2, "max_num_batched_tokens": 8,
                       "max_model_len": 96}, speculative_config=SPEC)
    return llm, hf


@torch.no_grad()
def hf_digits(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1]
        ids.append(int(DIGITS[logits[DIGITS].argmax()]))
    return ids[len(prompt):]


def test_a_grammar_cuts_the_drafts_and_masks_the_verify_rows(engine):
    llm, hf = engine
    params = greedy(24, structured_outputs=StructuredOutputsParams(regex="[0-9]{24}"))
    got = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                 use_tqdm=False))
    assert got == [hf_digits(hf, p, 24) for p in PROMPTS]
    stats = llm.llm_engine.scheduler.make_stats().spec_decoding
    assert stats.num_accepted_tokens > 5
