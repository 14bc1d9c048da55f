"""SamplingParams: vLLM defaults, normalisation, and validation messages naming the parameter."""

import re

import pytest

from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.max_tokens == 16  # vLLM's
    assert SamplingParams(seed=-1).seed is None  # vLLM: -1 means no seed
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop_token_ids=[5, 3, 5]).stop_token_ids == [5, 3]
    assert SamplingParams(top_k=-1).top_k == 0  # both 0 and -1 mean "off"
    assert SamplingParams(logprobs=True).logprobs == 1


def test_greedy_turns_truncation_off():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    q = SamplingParams(temperature=1e-6, top_k=3, seed=1)
    assert (q.top_k, q.seed) == (0, 1)


def test_small_positive_temperature_is_kept():
    p = SamplingParams(temperature=1e-3, top_k=3)
    assert (p.temperature, p.top_k) == (1e-3, 3)


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1] and q == SamplingParams(
        stop=["a", "b"], stop_token_ids=[1, 2])


def test_uses_penalties_and_buffer_length():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    included = SamplingParams(stop=["ab"], include_stop_str_in_output=True)
    assert included.output_text_buffer_length == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be a finite non-negative number, got -0.1."),
    (dict(temperature=float("nan")), "temperature must be a finite non-negative number, got nan."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
    (dict(top_k=-2), "top_k must be 0 or -1 (disabled), or at least 1, got -2."),
    (dict(top_k=1.5), "top_k must be an int, got float."),
    (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1."),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1."),
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(n=2, temperature=0), "n must be 1 when using greedy sampling, got 2."),
    (dict(max_tokens=0), "max_tokens must be an int of at least 1, got 0."),
    (dict(min_tokens=-1), "min_tokens must be at least 0, got -1."),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be at most max_tokens=4, got 5."),
    (dict(repetition_penalty=0.0),
     "repetition_penalty must be a finite number greater than zero, got 0.0."),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2], got -2.5."),
    (dict(logprobs=-2), "logprobs must be None, -1 (the whole vocabulary) or >= 0, got -2."),
    (dict(prompt_logprobs=-2),
     "prompt_logprobs must be None, -1 (the whole vocabulary) or >= 0, got -2."),
    (dict(bad_words="foo"), "bad_words must be a list of non-blank strings, got 'foo'."),
    (dict(bad_words=["ok", " "]), "bad_words must be a list of non-blank strings"),
    (dict(bad_words=[3]), "bad_words must be a list of non-blank strings, got [3]."),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!"),
    (dict(allowed_token_ids=[1, 2.0]),
     "allowed_token_ids must be a list of non-negative ints, got [1, 2.0]."),
    (dict(allowed_token_ids=[True]), "allowed_token_ids must be a list of non-negative ints"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids must be a list of non-negative ints"),
    (dict(allowed_token_ids=5), "allowed_token_ids must be a list of non-negative ints, got 5."),
    (dict(stop=["ok", ""]), "stop must contain only non-empty strings, got ['ok', '']."),
    (dict(stop_token_ids=[1, -3]),
     "stop_token_ids must contain only non-negative ints, got [1, -3]."),
    (dict(stop="x", detokenize=False), "stop strings need detokenize=True."),
    # Types: a float, bool or string where an int is meant, and the reverse.
    (dict(logprobs=2.5), "logprobs must be an int or None, got float."),
    (dict(prompt_logprobs=2.5), "prompt_logprobs must be an int or None, got float."),
    (dict(prompt_logprobs="3"), "prompt_logprobs must be an int or None, got str."),
    (dict(n=2.0), "n must be an int, got float."),
    (dict(n=True), "n must be an int, got bool."),
    (dict(max_tokens=16.0), "max_tokens must be an int, got float."),
    (dict(min_tokens=None), "min_tokens must be an int, got NoneType."),
    (dict(seed=1.5), "seed must be an int or None, got float."),
    (dict(seed=True), "seed must be an int or None, got bool."),
    (dict(temperature="0.7"), "temperature must be a number, got str."),
    (dict(top_p=None), "top_p must be a number, got NoneType."),
    (dict(presence_penalty=True), "presence_penalty must be a number, got bool."),
    (dict(min_p=float("nan")), "min_p must be in [0, 1], got nan."),
    (dict(ignore_eos=1), "ignore_eos must be a bool, got int."),
    (dict(detokenize="yes"), "detokenize must be a bool, got str."),
    (dict(stop_token_ids=[1, 2.0]),
     "stop_token_ids must contain only non-negative ints, got [1, 2.0]."),
    (dict(stop_token_ids=[True]), "stop_token_ids must contain only non-negative ints, got [True]."),
    (dict(stop_token_ids="7"), "stop_token_ids must contain only non-negative ints, got 7."),
    (dict(stop=[3]), "stop must contain only non-empty strings, got [3]."),
    (dict(stop=5), "stop must contain only non-empty strings, got 5."),
])
def test_validation_names_parameter_and_range(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_logprobs_cap_is_the_engines():
    # As in vLLM: any count (or -1, the whole vocabulary) constructs; the engine's
    # max_logprobs is checked at admission (tests/engine_e2e/test_e2e_validation.py).
    p = SamplingParams(logprobs=-1, prompt_logprobs=MAX_LOGPROBS + 1)
    assert (p.logprobs, p.prompt_logprobs) == (-1, MAX_LOGPROBS + 1)


def test_bad_words_and_allowed_token_ids_normalised():
    p = SamplingParams(bad_words=("a", "b c"), allowed_token_ids=(3, 1))
    assert p.bad_words == ["a", "b c"] and p.allowed_token_ids == [3, 1]
    assert p.bad_words_token_ids is None  # filled by the processor at admission
    assert SamplingParams().bad_words is None and SamplingParams().allowed_token_ids is None


def test_checked_clone_revalidates_mutated_params():
    p = SamplingParams(temperature=0.5, n=2)
    p.n = 0
    with pytest.raises(ValueError, match=re.escape("n must be at least 1, got 0.")):
        p.checked_clone()
    p.n, p.logprobs = 2, True  # normalised in the copy, as at construction
    q = p.checked_clone()
    assert q.logprobs == 1 and p.logprobs is True
    p.temperature = 0.0  # greedy with n=2 is refused whenever it is checked
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        p.checked_clone()
