"""SamplingParams: vLLM defaults, normalisation, and validation messages naming the parameter."""

import re

import pytest

from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

F32_MAX = "3.4028234663852886e+38"


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
    (dict(temperature=-0.1), f"temperature must be in [0.0, {F32_MAX}], got -0.1."),
    (dict(temperature=float("nan")), f"temperature must be in [0.0, {F32_MAX}], got nan."),
    (dict(top_p=0.0), "top_p must be in (0.0, 1.0], got 0.0."),
    (dict(top_p=1.5), "top_p must be in (0.0, 1.0], got 1.5."),
    (dict(top_k=-2), "top_k must be 0 or -1 (disabled), or at least 1, got -2."),
    (dict(top_k=1.5), "top_k must be an int, got float."),
    (dict(min_p=-0.1), "min_p must be in [0.0, 1.0], got -0.1."),
    (dict(min_p=1.1), "min_p must be in [0.0, 1.0], got 1.1."),
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(n=2, temperature=0), "n must be 1 when using greedy sampling, got 2."),
    (dict(max_tokens=0), "max_tokens must be in [1, 2147483647], got 0."),
    (dict(min_tokens=-1), "min_tokens must be in [0, 2147483647], got -1."),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be at most max_tokens=4, got 5."),
    (dict(repetition_penalty=0.0),
     f"repetition_penalty must be in [1.401298464324817e-45, {F32_MAX}], got 0.0."),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2.0, 2.0], got 2.5."),
    (dict(frequency_penalty=-2.5), "frequency_penalty must be in [-2.0, 2.0], got -2.5."),
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
    (dict(min_p=float("nan")), "min_p must be in [0.0, 1.0], got nan."),
    (dict(ignore_eos=1), "ignore_eos must be a bool, got int."),
    (dict(detokenize="yes"), "detokenize must be a bool, got str."),
    (dict(stop_token_ids=[1, 2.0]),
     "stop_token_ids must contain only non-negative ints, got [1, 2.0]."),
    (dict(stop_token_ids=[True]), "stop_token_ids must contain only non-negative ints, got [True]."),
    (dict(stop_token_ids="7"), "stop_token_ids must contain only non-negative ints, got 7."),
    (dict(stop=[3]), "stop must contain only non-empty strings, got [3]."),
    (dict(stop=5), "stop must contain only non-empty strings, got 5."),
    # The widths the step stores them in (issue 15, bug 2): token counts are int32, seeds
    # 64 bits, the float knobs float32.
    (dict(max_tokens=2**31), "max_tokens must be in [1, 2147483647], got 2147483648."),
    (dict(min_tokens=2**31, max_tokens=2**31),
     "max_tokens must be in [1, 2147483647], got 2147483648."),
    (dict(min_tokens=2**31), "min_tokens must be in [0, 2147483647], got 2147483648."),
    (dict(seed=2**63), "seed must be in [-9223372036854775808, 9223372036854775807], got "
                       "9223372036854775808."),
    (dict(seed=-2**63 - 1), "seed must be in [-9223372036854775808, 9223372036854775807], "
                            "got -9223372036854775809."),
    (dict(temperature=1e300), f"temperature must be in [0.0, {F32_MAX}], got 1e+300."),
    (dict(temperature=float("inf")), f"temperature must be in [0.0, {F32_MAX}], got inf."),
    (dict(temperature=10**70), f"temperature must be in [0.0, {F32_MAX}], got {10**70}."),
    (dict(temperature=10**400), f"temperature must be in [0.0, {F32_MAX}], got an int of 1329 "
                                "bits."),
    (dict(repetition_penalty=1e-300),
     f"repetition_penalty must be in [1.401298464324817e-45, {F32_MAX}], got 1e-300."),
    (dict(repetition_penalty=float("inf")),
     f"repetition_penalty must be in [1.401298464324817e-45, {F32_MAX}], got inf."),
    # Text that no tokenizer can take (issue 15, bug 3).
    (dict(stop=["ok", "\ud800"]),
     "stop is not valid Unicode text: it holds the lone surrogate '\\ud800' at character 0"),
    (dict(bad_words=["ab\udfff"]),
     "bad_words is not valid Unicode text: it holds the lone surrogate '\\udfff' at "
     "character 2"),
    (dict(top_p=float("nan")), "top_p must be in (0.0, 1.0], got nan."),
    (dict(presence_penalty=float("-inf")), "presence_penalty must be in [-2.0, 2.0], got -inf."),
])
def test_validation_names_parameter_and_range(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=2**31 - 1, min_tokens=2**31 - 1), dict(seed=2**63 - 1), dict(seed=-2**63),
    dict(top_k=2**31), dict(top_k=2**63), dict(top_p=1e-300), dict(top_p=5e-324),
    dict(temperature=3.4028234663852886e38), dict(repetition_penalty=2.0**-149),
    dict(repetition_penalty=3.4028234663852886e38), dict(min_p=5e-324)])
def test_the_edges_of_each_width_are_accepted(kwargs):
    # top_k of any size is vLLM's "keep k" (off at k >= the vocabulary); a top_p that float32
    # rounds to 0 keeps the top token (tests/runner/test_sampler.py).
    p = SamplingParams(**kwargs)
    assert all(getattr(p, k) == v for k, v in kwargs.items())


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
