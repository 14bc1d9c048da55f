"""Numbers at the edges of the widths the step stores them in, and text that is not valid
Unicode: each is refused at admission with a ValueError naming its parameter, or runs
through real steps beside a good request that it must not disturb (issue 15, bugs 2, 3, 6).

First a regression test per repro of the issue, then a hypothesis property test: boundary
values (0, -1, 2^31 - 1, 2^31, 2^63, NaN, +-inf, subnormals, ...) in every numeric field of
SamplingParams and of `generate`.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxllm import SamplingParams

from engine_state import assert_nothing_left
from tiny_model import greedy, token_ids

VOCAB = 49152
MAX_MODEL_LEN = 32  # short, so that an accepted max_tokens of 2^31 - 1 ends in a few steps
MAX_LOGPROBS = 5
GOOD = {"prompt_token_ids": [100, 200, 300, 400]}
SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def llm(make_tiny_llm):
    return make_tiny_llm(max_model_len=MAX_MODEL_LEN, max_logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def baseline(llm):
    return token_ids(llm.generate(GOOD, greedy(4), use_tqdm=False))[0]


def seeded(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, **kwargs)


# ---- the repros --------------------------------------------------------------------

def test_a_top_k_past_int32_is_off_and_fails_no_other_request(llm, baseline):
    # It overflowed the int32 top_k array, and the whole step failed (StepFailed), killing
    # the other requests of the batch. vLLM treats any k >= the vocabulary as off.
    plain, huge, huger, good = llm.generate(
        [GOOD] * 4, [seeded(), seeded(top_k=2**31), seeded(top_k=2**63), greedy(4)],
        use_tqdm=False)
    assert token_ids([huge, huger]) == token_ids([plain]) * 2
    assert token_ids([good]) == [baseline]
    assert_nothing_left(llm)


def test_min_and_max_tokens_past_int32_are_refused_before_anything_is_queued(llm, baseline):
    engine = llm.llm_engine
    engine.add_request(None, GOOD["prompt_token_ids"], greedy(4), request_id="in-flight")
    engine.step()
    mutated = SamplingParams()
    mutated.min_tokens = mutated.max_tokens = 2**31  # checked again at admission
    for params in (mutated, dict(min_tokens=2**31, max_tokens=2**31)):
        with pytest.raises(ValueError, match=re.escape(
                "max_tokens must be in [1, 2147483647], got 2147483648.")):
            engine.add_request(None, [1, 2], params if isinstance(params, SamplingParams)
                               else SamplingParams(**params))
    assert sorted(engine.scheduler.requests) == ["in-flight"]
    done = []
    while engine.has_unfinished_requests():
        done += [out for out in engine.step() if out.finished]
    assert token_ids(done) == [baseline]
    assert_nothing_left(llm)


def test_int32_max_min_tokens_runs_to_the_context_limit(llm):
    out, = llm.generate(GOOD, SamplingParams(min_tokens=2**31 - 1, max_tokens=2**31 - 1,
                                             temperature=0.0), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == MAX_MODEL_LEN - len(GOOD["prompt_token_ids"])


def test_a_top_p_that_float32_rounds_to_zero_samples_the_greedy_tokens(llm):
    # 1e-300 is 0.0 in float32: every row sampled token 0 (bug 6). vLLM keeps the top token.
    tiny = llm.generate([GOOD] * 2, [seeded(top_p=1e-300), greedy(6)], use_tqdm=False)
    assert token_ids(tiny[:1]) == token_ids(tiny[1:])
    assert token_ids(tiny[:1])[0] != [0] * 6


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.generate(SURROGATE, greedy(2), use_tqdm=False),
     "prompt is not valid Unicode text: it holds the lone surrogate '\\ud800' at character 0"),
    (lambda llm: llm.generate({"prompt": "ok " + SURROGATE}, greedy(2), use_tqdm=False),
     "prompt is not valid Unicode text: it holds the lone surrogate '\\ud800' at character 3"),
    (lambda llm: llm.chat([{"role": "user", "content": SURROGATE}], greedy(2), use_tqdm=False),
     "conversation 0, message 0.content is not valid Unicode text"),
    (lambda llm: llm.chat([{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
                          greedy(2), use_tqdm=False),
     "conversation 0, message 0.content[0].text is not valid Unicode text"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi", "name": SURROGATE}], greedy(2),
                          use_tqdm=False),
     "conversation 0, message 0.name is not valid Unicode text"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False,
                          chat_template="{{ messages[0].content }}" + SURROGATE),
     "chat_template is not valid Unicode text: it holds the lone surrogate '\\ud800' at "
     "character 25"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False,
                          chat_template_kwargs={"persona": SURROGATE}),
     "chat_template_kwargs.persona is not valid Unicode text"),
    # A template can make one from valid input.
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False,
                          chat_template="{{ '%c' % 55296 }}"),
     "the chat template's output for conversation 0 is not valid Unicode text"),
    (lambda llm: llm.generate(GOOD, greedy(2, bad_words=["ok", SURROGATE]), use_tqdm=False),
     "bad_words is not valid Unicode text"),
    (lambda llm: llm.generate(GOOD, greedy(2, stop=[SURROGATE]), use_tqdm=False),
     "stop is not valid Unicode text"),
])
def test_lone_surrogates_are_refused_naming_the_field(llm, baseline, call, message):
    # They reached the tokenizer, whose TypeError was a 500 over HTTP (bug 3).
    with pytest.raises(ValueError, match=re.escape(message)):
        call(llm)
    assert_nothing_left(llm)
    assert token_ids(llm.generate(GOOD, greedy(4), use_tqdm=False)) == [baseline]


# ---- every numeric field at its boundaries --------------------------------------------------

INTS = [0, -1, 1, 2, 2**31 - 1, 2**31, -2**31 - 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1,
        2**64, 10**400, VOCAB - 1, VOCAB]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 2.5, math.nan, math.inf, -math.inf,
          5e-324, 1e-300, 1e-46, 2.0**-149, 2.0**-126, 3.4028234663852886e38, 3.5e38, 1e300,
          float(2**31), float(2**63)]
SAMPLING_FIELDS = ["presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                   "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs",
                   "prompt_logprobs", "best_of", "stop_token_ids", "allowed_token_ids"]
# n is bounded by the engine's max_n_sequences (16384 here, vLLM's default): past it, refused
# at admission (an accepted n of 2^31 would fan out 2^31 requests).
N_VALUES = [0, -1, 1, 2, 3, 2.0, math.nan, math.inf, 5e-324, 16385, 2**31 - 1, 2**31, 2**63,
            10**400]


@st.composite
def boundary_calls(draw):
    """(the fields named by the call, SamplingParams overrides, prompt ids, priority)."""
    where = draw(st.sampled_from([*SAMPLING_FIELDS, "n", "min_and_max_tokens", "priority",
                                  "prompt_token_ids"]))
    value = (draw(st.sampled_from(N_VALUES)) if where == "n"
             else draw(st.sampled_from(INTS + FLOATS)))
    prompt, priority, fields = list(GOOD["prompt_token_ids"]), 0, {}
    if where in ("stop_token_ids", "allowed_token_ids"):
        fields = {where: [value]}
    elif where == "min_and_max_tokens":
        fields = {"min_tokens": value, "max_tokens": value}
    elif where == "prompt_token_ids":
        prompt.append(value)
    elif where == "priority":
        priority = value
    else:
        fields = {where: value}
    names = list(fields) or [where]
    return names, fields, prompt, priority


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=boundary_calls())
def test_each_boundary_value_runs_or_is_refused_naming_its_field(llm, baseline, call):
    names, fields, prompt, priority = call
    try:
        params = SamplingParams(**{"temperature": 0.8, "seed": 5, "max_tokens": 3, **fields})
        outs = llm.generate([GOOD, {"prompt_token_ids": prompt}], [greedy(4), params],
                            use_tqdm=False, priority=[0, priority])
    except ValueError as e:
        event(f"refused: {names[0]}")
        assert any(re.search(rf"\b{name}\b", str(e)) for name in names), (names, str(e))
        assert_nothing_left(llm)
        return
    event(f"ran: {names[0]}")
    good, drawn = outs
    assert token_ids([good]) == [baseline]
    room = MAX_MODEL_LEN - len(prompt)
    for c in drawn.outputs:
        assert 1 <= len(c.token_ids) <= min(params.max_tokens, room)
        assert all(0 <= t < VOCAB for t in c.token_ids)
        assert c.finish_reason in ("length", "stop")
        if params.allowed_token_ids:
            assert set(c.token_ids) <= set(params.allowed_token_ids)
        if params.logprobs is not None:
            assert all(not math.isnan(lp.logprob) for entry in c.logprobs
                       for lp in entry.values())
    assert_nothing_left(llm)
