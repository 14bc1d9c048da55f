"""bad_words, allowed_token_ids, logprobs_mode and max_logprobs=-1 through LLM.generate.

The engine runs with async scheduling (the default): a bad word's prefix is matched on the
device against tokens the host has not seen yet, so these checks also cover that."""

from __future__ import annotations

import math

import pytest

from jaxllm import SamplingParams
from jaxllm.config import EngineConfig

from tiny_model import greedy, token_ids

VOCAB = 49152
PROMPT = {"prompt_token_ids": [1, 400, 2035, 314, 1345, 28, 17]}


def second_best(logprob_dicts) -> list[int]:
    """Per step, the token of rank 2 (greedy samples rank 1)."""
    return [next(t for t, lp in d.items() if lp.rank == 2) for d in logprob_dicts]


def test_bad_word_sequences_are_matched_on_the_output(tiny_llm, monkeypatch):
    [base] = tiny_llm.generate(PROMPT, greedy(6, logprobs=2), use_tqdm=False)
    o = list(base.outputs[0].token_ids)
    alt = second_best(base.outputs[0].logprobs)
    sequences = {"three": [[o[1], o[2], o[3]]],  # banned at step 3 only: the prefix o1 o2
                 "prompt": [[PROMPT["prompt_token_ids"][-1], o[0]]],  # prefix in the prompt
                 "one": [[o[0]]]}  # a single token: banned at every step
    monkeypatch.setattr(tiny_llm.llm_engine.processor, "bad_words_token_ids",
                        lambda words: sequences[words[0]])
    outs = tiny_llm.generate([PROMPT] * 4, [greedy(6, bad_words=["three"]),
                                            greedy(6, bad_words=["prompt"]),
                                            greedy(6, bad_words=["one"]), greedy(6)],
                             use_tqdm=False)
    got = token_ids(outs)
    assert got[0][:4] == o[:3] + [alt[3]]
    assert got[1] == o and got[3] == o  # not an output prefix; a row that did not ask
    assert got[2][0] == alt[0] and o[0] not in got[2]


def test_bad_words_are_tokenized_as_vllm_does(tiny_llm, tokenizer):
    processor = tiny_llm.llm_engine.processor
    for word in ["hello", " world", "Paris is", "xqzj"]:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        expected = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain)
                              else [])
        assert processor.bad_words_token_ids([word]) == expected, word
    assert len(processor.bad_words_token_ids(["hello"])) == 2  # "hello" and " hello"
    # A real word, end to end: the greedy output's first token, as text, is never generated.
    [base] = tiny_llm.generate(PROMPT, greedy(6), use_tqdm=False)
    word = tokenizer.decode(base.outputs[0].token_ids[:1])
    banned = [s[0] for s in processor.bad_words_token_ids([word]) if len(s) == 1]
    assert base.outputs[0].token_ids[0] in banned
    [out] = tiny_llm.generate(PROMPT, greedy(6, bad_words=[word]), use_tqdm=False)
    assert not set(out.outputs[0].token_ids) & set(banned)


def test_bad_words_over_the_static_width_are_rejected(tiny_llm):
    with pytest.raises(ValueError, match="bad_words supports at most 32 token sequences"):
        tiny_llm.generate(PROMPT, greedy(2, bad_words=[f"w{i}" for i in range(40)]),
                          use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words supports at most"):
        tiny_llm.generate(PROMPT, greedy(2, bad_words=[" ".join(["ab"] * 20)]), use_tqdm=False)


def test_allowed_token_ids(tiny_llm):
    [base] = tiny_llm.generate(PROMPT, greedy(6), use_tqdm=False)
    allowed = [17, 400, 2035, VOCAB - 1]
    outs = tiny_llm.generate([PROMPT] * 3, [
        greedy(6, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                       allowed_token_ids=[2035]),
        greedy(6)], use_tqdm=False)
    got = token_ids(outs)
    assert set(got[0]) <= set(allowed)
    assert got[1] == [2035] * 6
    assert got[2] == list(base.outputs[0].token_ids)  # bit-identical beside the others
    with pytest.raises(ValueError, match=rf"allowed_token_ids must be in \[0, {VOCAB}\)"):
        tiny_llm.generate(PROMPT, greedy(2, allowed_token_ids=[VOCAB]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids is not None and empty"):
        tiny_llm.generate(PROMPT, greedy(2, allowed_token_ids=[]), use_tqdm=False)


def test_engine_options_are_validated():
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \('raw_logprobs'"):
        EngineConfig(logprobs_mode="logits")
    with pytest.raises(ValueError, match="max_logprobs must be -1 .no cap. or >= 0, got -2"):
        EngineConfig(max_logprobs=-2)


def test_processed_logprobs_and_the_whole_vocabulary(make_tiny_llm, tiny_llm):
    llm = make_tiny_llm(logprobs_mode="processed_logprobs", max_logprobs=-1)
    allowed = [17, 400, 2035]
    [out, plain] = llm.generate([PROMPT] * 2, [greedy(2, logprobs=-1, allowed_token_ids=allowed),
                                               greedy(2, logprobs=2)], use_tqdm=False)
    for d in out.outputs[0].logprobs:
        assert len(d) == VOCAB  # the sampled token is also in the top V
        finite = {t: lp.logprob for t, lp in d.items() if math.isfinite(lp.logprob)}
        assert sorted(finite) == allowed
        assert math.isclose(sum(math.exp(v) for v in finite.values()), 1.0, rel_tol=1e-5)
    # Greedy without penalties: processed = raw logprobs, as in the default engine.
    [raw] = tiny_llm.generate(PROMPT, greedy(2, logprobs=2), use_tqdm=False)
    for a, b in zip(plain.outputs[0].logprobs, raw.outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-5) for t in a)
