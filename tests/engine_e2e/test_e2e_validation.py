"""Admission checks: a bad request raises ValueError naming the parameter and its allowed range,
before anything is added, so requests already in flight are never disturbed."""

from __future__ import annotations

import pytest

from jaxllm import SamplingParams

from tiny_model import greedy, token_ids

MAX_MODEL_LEN = 256
MAX_LOGPROBS = 5
VOCAB = 49152


@pytest.fixture(scope="module")
def llm(make_tiny_llm):
    return make_tiny_llm(max_logprobs=MAX_LOGPROBS)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=rf"length {MAX_MODEL_LEN + 1}\b.*{MAX_MODEL_LEN}\b"):
        llm.generate({"prompt_token_ids": [5] * (MAX_MODEL_LEN + 1)}, greedy(4), use_tqdm=False)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt cannot be empty"):
        llm.generate({"prompt_token_ids": []}, greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt cannot be empty"):
        llm.generate("", greedy(4), use_tqdm=False)


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_token_ids_outside_the_vocabulary(llm, bad):
    with pytest.raises(ValueError, match=rf"Token id {bad} .*prompt_token_ids.*\[0, {VOCAB}\)"):
        llm.generate({"prompt_token_ids": [1, 2, bad]}, greedy(4), use_tqdm=False)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_over_the_engine_cap(llm, name):
    params = greedy(4, **{name: MAX_LOGPROBS + 1})
    with pytest.raises(ValueError, match=rf"{name} of {MAX_LOGPROBS + 1}.*max allowed: "
                                         rf"{MAX_LOGPROBS}"):
        llm.generate("Hello", params, use_tqdm=False)


def test_logprobs_minus_one_is_the_vocabulary_over_the_cap(llm):
    with pytest.raises(ValueError, match=rf"logprobs of {VOCAB}.*max allowed: {MAX_LOGPROBS}"):
        llm.generate("Hello", greedy(4, logprobs=-1), use_tqdm=False)


def test_sampling_params_list_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match=r"prompts \(2\) and sampling_params \(3\)"):
        llm.generate(["a", "b"], [greedy(2)] * 3, use_tqdm=False)


def test_a_bad_prompt_in_a_batch_adds_nothing(llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate(["Hello", {"prompt_token_ids": [VOCAB + 7]}], greedy(4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out, = llm.generate("Hello", greedy(4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_rejected_requests_do_not_disturb_requests_in_flight(llm, tokenizer):
    prompts = [tokenizer(t)["input_ids"] for t in ("The weather today", "Hello, my name is")]
    params = [greedy(12), SamplingParams(temperature=1.0, seed=5, max_tokens=10,
                                         ignore_eos=True, logprobs=2)]
    expected = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    engine = llm.llm_engine
    engine.add_request(None, prompts[0], params[0], request_id="good-0")
    engine.step()  # good-0 is running when the bad ones arrive; good-1 will be waiting
    engine.add_request(None, prompts[1], params[1], request_id="good-1")
    bad = [
        ([5] * (MAX_MODEL_LEN + 1), greedy(4), None, "maximum model length"),
        ([], greedy(4), None, "cannot be empty"),
        ([1, VOCAB], greedy(4), None, "out of vocabulary"),
        ([1, 2], greedy(4, logprobs=MAX_LOGPROBS + 1), None, "max allowed"),
        ([1, 2], greedy(4), "good-0", "good-0"),  # an id already in flight
        ([1, 2], greedy(4), "good-1", "good-1"),
    ]
    for ids, p, request_id, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(None, ids, p, request_id=request_id)

    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert sorted(done) == ["good-0", "good-1"]
    got = [done["good-0"], done["good-1"]]
    assert token_ids(got) == token_ids(expected)
    assert [o.prompt_token_ids for o in got] == prompts
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert not engine.output_processor.has_unfinished()


def test_text_that_cannot_fit_is_refused_before_tokenizing(llm):
    limit = MAX_MODEL_LEN * 81  # SmolLM2's longest token spans 81 characters
    assert llm.llm_engine.processor.max_prompt_chars == limit
    with pytest.raises(ValueError, match=rf"^The prompt has {limit + 1} characters; the limit "
                                         rf"is {limit} \(the maximum model length of "
                                         rf"{MAX_MODEL_LEN} tokens times 81"):
        llm.generate("x" * (limit + 1), greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^The rendered chat prompt has \d+ characters"):
        llm.chat([{"role": "user", "content": "y" * limit}], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^bad_words supports at most 32 token sequences "
                                         r"of at most 16 tokens \(at most 1296 characters; "
                                         r"each word is one or two sequences\), got 1 words, "
                                         r"the longest of 20737 characters$"):
        llm.generate("Hi", greedy(4, bad_words=["z" * (limit + 1)]), use_tqdm=False)


@pytest.mark.parametrize("n", [16385, 2**31, 2**63, 10**400])
def test_n_is_capped_by_max_n_sequences(llm, n):
    with pytest.raises(ValueError, match=rf"^n must be at most 16384 \(the engine's "
                                         rf"max_n_sequences\), got {n}$") as refused:
        llm.generate("Hi", SamplingParams(n=n, temperature=1.0, max_tokens=1),
                     use_tqdm=False)
    assert refused.value.param == "n"  # the server states it as the error's param
