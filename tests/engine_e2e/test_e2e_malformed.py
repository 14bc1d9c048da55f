"""No input wedges the engine: malformed calls raise ValueError before anything is queued.

Regression tests for every input that once reached `step()` and wedged the engine, then a
hypothesis property test: random malformed calls against one LLM, each followed by the
checks that nothing is queued, every block is free, and a good request still gives the
baseline tokens.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm import SamplingParams

from engine_state import assert_nothing_left
from tiny_model import greedy, token_ids

VOCAB = 49152
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 5
GOOD_PROMPT = [100, 200, 300, 400]


@pytest.fixture(scope="module")
def llm(make_tiny_llm):
    return make_tiny_llm(max_logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def baseline(llm):
    return token_ids(llm.generate({"prompt_token_ids": GOOD_PROMPT}, greedy(6),
                                  use_tqdm=False))[0]


def mutated(**fields) -> SamplingParams:
    """Valid at construction, then changed behind the constructor's back (users do this)."""
    p = SamplingParams(temperature=0.7, max_tokens=6)
    for name, value in fields.items():
        setattr(p, name, value)
    return p


# ---- the inputs that used to wedge the engine, and their neighbours -----------------------

@pytest.mark.parametrize("fields, message", [
    (dict(logprobs=2.5), "logprobs must be an int or None, got float"),
    (dict(prompt_logprobs=2.5), "prompt_logprobs must be an int or None, got float"),
    (dict(min_tokens=2, stop_token_ids=[2**31 + 5]),
     rf"stop_token_ids must be in \[0, {VOCAB}\), got {2**31 + 5}"),
    (dict(min_tokens=1, stop_token_ids=list(range(1000, 1032))),
     "min_tokens supports at most 32 EOS \\+ stop_token_ids, got 33"),
    (dict(n=0), "n must be at least 1, got 0"),
    (dict(n=2, temperature=0.0), "n must be 1 when using greedy sampling"),
    (dict(max_tokens=4.0), "max_tokens must be an int, got float"),
    (dict(logprobs=MAX_LOGPROBS + 1), f"logprobs of {MAX_LOGPROBS + 1}.*max allowed"),
    (dict(stop_token_ids=[VOCAB]), rf"stop_token_ids must be in \[0, {VOCAB}\), got {VOCAB}"),
    (dict(temperature="hot"), "temperature must be a number, got str"),
    (dict(ignore_eos="yes"), "ignore_eos must be a bool, got str"),
    # Accepted by the constructor, refused at generate (as vLLM v1 does).
    (dict(logits_processors=[lambda ids, logits: logits]), "logits_processors are not supported"),
    (dict(best_of=3), "best_of is not supported"),
])
def test_mutated_params_are_rejected_at_admission(llm, baseline, fields, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": GOOD_PROMPT}] * 2, mutated(**fields),
                     use_tqdm=False)
    assert_nothing_left(llm)
    assert token_ids(llm.generate({"prompt_token_ids": GOOD_PROMPT}, greedy(6),
                                  use_tqdm=False)) == [baseline]


@pytest.mark.parametrize("sampling_params, message", [
    ("greedy", "sampling_params must be a SamplingParams or a list of them, got str"),
    ({"temperature": 0}, "sampling_params must be a SamplingParams or a list of them, got dict"),
    ([SamplingParams(), "x"], r"sampling_params\[1\] must be a SamplingParams, got str"),
    ([SamplingParams(), {"n": 1}], r"sampling_params\[1\] must be a SamplingParams, got dict"),
    (3, "sampling_params must be a SamplingParams or a list of them, got int"),
])
def test_every_sampling_params_entry_is_a_sampling_params(llm, sampling_params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["a", "b"], sampling_params, use_tqdm=False)
    assert_nothing_left(llm)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [1, 2.0, 3]}, "prompt_token_ids must contain only ints; got float"),
    ({"prompt_token_ids": [1, True]}, "prompt_token_ids must contain only ints; got bool"),
    ({"prompt_token_ids": ["5"]}, "prompt_token_ids must contain only ints; got str"),
    ({"prompt_token_ids": "12"}, "prompt_token_ids must be a list, got str"),
    ({"prompt_token_ids": [2**40]}, "out of vocabulary"),
    ({"prompt": 5}, "prompt must be a str, got int"),
    (7, "each prompt must be a str, or a dict"),
])
def test_malformed_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", prompt], greedy(3), use_tqdm=False)
    assert_nothing_left(llm)


@pytest.mark.parametrize("messages, message", [
    ([{"role": 5, "content": "hi"}], "role must be a non-empty string"),
    ([{"content": "hi"}], "role must be a non-empty string"),
    ([{"role": "user"}], "content must be a string"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "content must be a string"),
    (["hello"], "conversation 0 must be a non-empty list of messages, got str"),
    ([[]], "must be a non-empty list of messages"),
])
def test_chat_messages_are_checked_before_the_template(llm, messages, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, greedy(3), use_tqdm=False)
    assert_nothing_left(llm)


def test_a_colliding_request_id_admits_nothing_of_the_batch(llm):
    from jaxllm.engine.processor import PromptInput

    engine = llm.llm_engine
    prompts = [PromptInput(None, GOOD_PROMPT)] * 2
    with pytest.raises(ValueError, match="'dup' is already in flight"):
        engine.add_requests(prompts, [greedy(3)] * 2, ["dup", "dup"])
    assert_nothing_left(llm)
    engine.add_request(None, GOOD_PROMPT, greedy(3), request_id="live")
    with pytest.raises(ValueError, match="'live' is already in flight"):
        engine.add_requests(prompts, [greedy(3)] * 2, ["fresh", "live"])
    assert sorted(engine.scheduler.requests) == ["live"]
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_left(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(attention_backend="bogus"), "attention_backend must be one of"),
    (dict(seed="x"), "seed must be an int, got str"),
    (dict(seed=1.5), "seed must be an int, got float"),
    (dict(max_num_seqs=2.0), "max_num_seqs must be an int, got float"),
    (dict(enforce_eager="no"), "enforce_eager must be a bool, got str"),
    (dict(data_parallel_size=0), "data_parallel_size must be >= 1, got 0"),
    (dict(data_parallel_size=2), r"LLM\(...\) runs one engine; data_parallel_size=2 is served "
                                 "by AsyncLLM"),
])
def test_engine_arguments_are_checked_at_construction(tiny_model_dir, kwargs, message):
    from jaxllm import LLM

    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_dir, **kwargs)


def test_an_empty_model_name_is_rejected():
    from jaxllm import LLM

    with pytest.raises(ValueError, match="model must be a non-empty string or None, got ''"):
        LLM("")


# ---- random malformed calls ---------------------------------------------------------------

BAD_VALUES = {
    "n": [0, -1, 2.5, "2", None, True],
    "max_tokens": [0, -3, 1.5, "8", None],
    "min_tokens": [-1, 1.5, "1", 10_000],
    "top_k": [-2, 0.5, "3", None],
    "logprobs": [2.5, -1, MAX_LOGPROBS + 1, "1", 10**9],
    "prompt_logprobs": [2.5, -2, MAX_LOGPROBS + 1, "2"],
    "seed": [1.5, "seed", [1]],
    "temperature": [-0.1, math.nan, math.inf, "0.5", None, True],
    "top_p": [0.0, 1.5, math.nan, "1", None],
    "min_p": [-0.5, 1.5, math.nan, "0"],
    "presence_penalty": [3.0, -2.5, math.nan, "0", True],
    "frequency_penalty": [3.0, math.nan, None],
    "repetition_penalty": [0.0, -1.0, math.inf, "1"],
    "stop_token_ids": [[-1], [VOCAB], [2**31 + 1], [2**63], [1.0], [True], "7", [None]],
    "stop": [[""], [3], 5, [None]],
    "ignore_eos": [1, "true", None],
    "detokenize": [0, "no"],
    "skip_special_tokens": [None, 1],
}

BAD_PROMPTS = [[], [-1], [VOCAB], [2**31], [1.5], [True, 2], ["3"], [[1, 2]], [None],
               [0] * (MAX_MODEL_LEN + 1)]


@st.composite
def malformed_calls(draw):
    """(kind, argument) of one malformed call, and how many good prompts ride along."""
    kind = draw(st.sampled_from(["params", "prompt", "container", "chat", "min_tokens_ids"]))
    riders = draw(st.integers(0, 3))
    if kind == "params":
        name = draw(st.sampled_from(sorted(BAD_VALUES)))
        return kind, {name: draw(st.sampled_from(BAD_VALUES[name]))}, riders
    if kind == "prompt":
        return kind, draw(st.sampled_from(BAD_PROMPTS)), riders
    if kind == "container":
        return kind, draw(st.sampled_from(["x", {"n": 1}, 5, [None], [greedy(2), "y"]])), 1
    if kind == "chat":
        return kind, draw(st.sampled_from([
            [{"role": 7, "content": "hi"}], [{"content": "hi"}],
            [{"role": "user", "content": None}], [{"role": "user", "content": {"a": 1}}],
            [{"role": "user", "content": [{"type": "text"}]}], [5], []])), riders
    count = draw(st.integers(32, 40))
    return kind, {"min_tokens": 1, "stop_token_ids": list(range(500, 500 + count))}, riders


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=malformed_calls())
def test_random_malformed_calls_never_wedge_the_engine(llm, baseline, call):
    kind, arg, riders = call
    good = [{"prompt_token_ids": GOOD_PROMPT}] * riders
    with pytest.raises(ValueError):
        if kind in ("params", "min_tokens_ids"):
            llm.generate(good + [{"prompt_token_ids": GOOD_PROMPT}],
                         [greedy(6)] * riders + [mutated(**arg)], use_tqdm=False)
        elif kind == "prompt":
            llm.generate(good + [{"prompt_token_ids": arg}], greedy(6), use_tqdm=False)
        elif kind == "container":
            llm.generate(good, arg, use_tqdm=False)
        else:
            llm.chat([[{"role": "user", "content": "hi"}]] * riders + [arg], greedy(6),
                     use_tqdm=False)
    assert_nothing_left(llm)
    assert token_ids(llm.generate({"prompt_token_ids": GOOD_PROMPT}, greedy(6),
                                  use_tqdm=False)) == [baseline]
