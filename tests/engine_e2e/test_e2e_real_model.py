"""The real SmolLM2-135M-Instruct end to end: batching changes nothing, greedy decoding equals
HF transformers' own greedy loop on the same GGUF, and EOS handling (min_tokens, ignore_eos).

The greedy continuations of each prompt run alone are computed once (`alone`) and are the
reference for both the batch and HF. The longest prompt (> 64 tokens) is prefilled in
chunks under the 64-token budget.
"""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams

from tiny_model import SMALL, greedy, metric_values, token_ids

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ("The history of the printing press begins in the fifteenth century, when Johannes "
     "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
     "those used to make wine. Within fifty years, printing shops had spread to more than "
     "two hundred cities across Europe, and the price of books fell so far that ordinary "
     "merchants and craftsmen could afford them. Historians agree that"),
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids) and len(ids[-1]) > 64
    return ids


@pytest.fixture(scope="module")
def alone(real_llm, prompt_ids) -> list[list[int]]:
    return [token_ids(real_llm.generate({"prompt_token_ids": ids}, greedy(NUM_TOKENS),
                                        use_tqdm=False))[0] for ids in prompt_ids]


def test_greedy_batch_equals_each_prompt_alone(real_llm, prompt_ids, alone):
    batch = real_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                              greedy(NUM_TOKENS), use_tqdm=False)
    assert token_ids(batch) == alone


def test_preemption_gives_the_same_tokens(tiny_model_dir, prompt_ids, alone):
    """The batch again, on a KV cache of 1.5 sequences of max_model_len=128 (12 blocks for
    the batch's 18): preempted requests are recomputed and still match."""
    # The tokenizer saved in the tiny model's directory is SmolLM2's: it loads faster than
    # parsing it out of the GGUF again.
    tight = LLM(**{**SMALL, "max_model_len": 128, "num_gpu_blocks_override": 13,
                   "tokenizer": tiny_model_dir})
    batch = tight.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                           greedy(NUM_TOKENS), use_tqdm=False)
    assert metric_values(tight)["jaxllm:num_preemptions_total"] > 0
    assert token_ids(batch) == alone


def test_greedy_equals_hf_transformers(hf_smollm2, prompt_ids, alone, tokenizer):
    import torch

    # One thread: on a shared 2-core machine torch's thread pool spins and runs ~6x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            hf_outputs = [hf_smollm2.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=NUM_TOKENS,
                pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
                for ids in prompt_ids]
    finally:
        torch.set_num_threads(threads)
    for ids, ours, hf in zip(prompt_ids, alone, hf_outputs):
        # HF stops at EOS; ours ignored it, so it must have produced the same EOS there.
        assert len(hf) == NUM_TOKENS or hf[-1] == tokenizer.eos_token_id
        assert ours[:len(hf)] == hf, tokenizer.decode(ids)


def test_eos_min_tokens_and_ignore_eos(real_llm, tokenizer):
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    eos = tokenizer.eos_token_id
    natural = real_llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=64),
                            use_tqdm=False)[0].outputs[0]
    n = len(natural.token_ids)
    assert (natural.finish_reason, natural.stop_reason) == ("stop", None)
    assert natural.token_ids[-1] == eos and n < 64
    assert natural.text == tokenizer.decode(natural.token_ids[:-1])

    delayed = real_llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=64,
                                                 min_tokens=n + 4), use_tqdm=False)[0].outputs[0]
    assert len(delayed.token_ids) >= n + 4
    assert list(delayed.token_ids[:n - 1]) == list(natural.token_ids[:n - 1])
    assert eos not in delayed.token_ids[:n + 4]

    ignored = real_llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=n + 4,
                                                 ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == n + 4 and ignored.finish_reason == "length"
    assert list(ignored.token_ids[:n]) == list(natural.token_ids)
