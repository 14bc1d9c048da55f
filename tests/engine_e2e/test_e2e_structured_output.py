"""Structured outputs end to end: every finished output obeys its constraint, and constraints
change nothing else.

* validity: 200 generated JSON schemas (nested objects, enums, arrays, integers, strings,
  booleans, required fields) sampled at temperature 1.0 on the real SmolLM2, and regexes,
  choices, a Lark grammar and json_object: every "stop" output parses and validates
  (jsonschema) or fullmatches;
* constrained and plain requests in one batch: the plain ones' greedy tokens are exactly
  those they get without the constrained ones;
* async and synchronous scheduling give the same constrained outputs; preemption (a tight KV
  cache, tiny model) gives the same tokens as a roomy cache;
* n > 1, logprobs, stop strings, min_tokens and max_tokens ("length") on constrained
  requests; bad specs are ValueErrors naming the field, and a grammar that fails to compile
  while serving fails that request alone.
The warm-up test (test_e2e_warmup.py) shows constrained requests compile nothing.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxllm import SamplingParams, StructuredOutputsParams

from tiny_model import SMALL

WORDS = ["name", "age", "city", "color", "size", "score", "tags", "id", "kind", "level",
         "owner", "items"]


def leaf_schema(rng) -> dict:
    kind = rng.integers(5)
    if kind == 0:
        return {"type": "integer", "minimum": 0, "maximum": int(rng.integers(5, 1000))}
    if kind == 1:
        return {"type": "string", "maxLength": int(rng.integers(1, 10))}
    if kind == 2:
        return {"type": "boolean"}
    if kind == 3:
        return {"enum": [str(w) for w in rng.choice(WORDS, int(rng.integers(2, 5)), False)]}
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": int(rng.integers(1, 4))}


def object_schema(rng, depth: int = 0) -> dict:
    names = [str(w) for w in rng.choice(WORDS, int(rng.integers(1, 4)), replace=False)]
    props = {n: object_schema(rng, depth + 1) if depth == 0 and rng.random() < 0.3
             else leaf_schema(rng) for n in names}
    return {"type": "object", "properties": props,
            "required": [n for n in names if rng.random() < 0.7],
            "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    from jaxllm import LLM
    return LLM(**{**SMALL, "max_num_seqs": 64, "max_num_batched_tokens": 256})


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def test_generated_schemas_are_valid(llm):
    rng = np.random.default_rng(0)
    distinct: dict[str, dict] = {}
    while len(distinct) < 200:
        schema = object_schema(rng)
        distinct.setdefault(json.dumps(schema, sort_keys=True), schema)
    schemas = list(distinct.values())
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64,
                             structured_outputs=StructuredOutputsParams(
                                 json=s, disable_any_whitespace=bool(i % 2)))
              for i, s in enumerate(schemas)]
    prompts = [f"Write a JSON object with the keys {', '.join(s['properties'])}:"
               for s in schemas]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert set(reasons) <= {"stop", "length"}
    finished = [(o.outputs[0].text, s) for o, s in zip(outputs, schemas)
                if o.outputs[0].finish_reason == "stop"]
    for text, schema in finished:
        jsonschema.validate(json.loads(text), schema)  # 100% of the finished ones
    assert len(finished) >= 160, reasons  # the rest reached max_tokens
    compact = [o.outputs[0].text for o, p in zip(outputs, params)
               if p.structured_outputs.disable_any_whitespace
               and o.outputs[0].finish_reason == "stop"]
    outside_strings = [re.sub(r'"(\\.|[^"\\])*"', '""', t) for t in compact]
    assert compact and not any(re.search(r"\s", t) for t in outside_strings)


REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
           r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])", r"#[0-9a-f]{6}",
           r"[a-z]+@[a-z]+\.(com|org)", r"-?[0-9]{1,4}\.[0-9]{2}", r"(ab|cd)+x"]
CHOICES = [["red", "green", "blue"], ["Paris", "London", "New York"], ["A", "B", "C", "D"],
           ["positive", "negative"]]


def test_regex_choice_grammar_and_json_object_are_valid(llm):
    constraints = ([StructuredOutputsParams(regex=r) for r in REGEXES]
                   + [StructuredOutputsParams(choice=c) for c in CHOICES]
                   + [StructuredOutputsParams(grammar='start: "(" num ("+" num)* ")"\n'
                                                      'num: /[0-9]{1,3}/'),
                      StructuredOutputsParams(json_object=True)]) * 4
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=c)
              for i, c in enumerate(constraints)]
    outputs = llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
    num_stopped = 0
    for out, c in zip(outputs, constraints):
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert reason in ("stop", "length")
        if reason != "stop":
            continue
        num_stopped += 1
        if c.regex is not None:
            assert re.fullmatch(c.regex, text), (c.regex, text)
        elif c.choice is not None:
            assert text in c.choice
        elif c.grammar is not None:
            assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text
        else:
            assert isinstance(json.loads(text), dict)
    assert num_stopped >= 0.75 * len(params)


MIXED_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
                 "List three colors:"]


def test_constrained_requests_leave_plain_greedy_tokens_unchanged(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 4
    alone = llm.generate(MIXED_PROMPTS, plain, use_tqdm=False)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs=c)
                   for i, c in enumerate([StructuredOutputsParams(regex=r"[a-z ]{30}"),
                                          StructuredOutputsParams(json_object=True),
                                          StructuredOutputsParams(choice=["x", "y"]),
                                          StructuredOutputsParams(regex=r"[0-9]+")])]
    mixed = llm.generate([p for pair in zip(MIXED_PROMPTS, MIXED_PROMPTS) for p in pair],
                         [p for pair in zip(plain, constrained) for p in pair],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == \
           [o.outputs[0].token_ids for o in alone]
    assert re.fullmatch(r"[a-z ]{0,30}", mixed[1].outputs[0].text)


def test_async_and_sync_scheduling_give_the_same_constrained_outputs(llm):
    constraints = [StructuredOutputsParams(json={"type": "object", "properties": {
                       "name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                       "required": ["name", "age"]}),
                   StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
                   StructuredOutputsParams(choice=["yes", "no"])]
    params = ([SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
               for c in constraints]
              + [SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=c)
                 for c in constraints]
              + [SamplingParams(temperature=0.0, max_tokens=20)])
    prompts = ["Describe a person as JSON:", "A phone number:", "Is water wet?"] * 2 + ["Hi"]
    core = llm.llm_engine.engine_core
    assert core.async_scheduling
    async_out = llm.generate(prompts, params, use_tqdm=False)
    core.async_scheduling = False
    try:
        sync_out = llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.async_scheduling = True
    assert [o.outputs[0].token_ids for o in sync_out] == \
           [o.outputs[0].token_ids for o in async_out]
    jsonschema.validate(json.loads(async_out[0].outputs[0].text), constraints[0].json)


def test_n_logprobs_stop_min_tokens_and_length(llm):
    letters = StructuredOutputsParams(regex=r"[a-z]{10,20}")
    out = llm.generate(["Spell:"] * 4, [
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30, logprobs=2,
                       structured_outputs=letters),
        SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=letters),
        SamplingParams(temperature=1.0, seed=2, max_tokens=30, stop=["e"],
                       structured_outputs=letters),
        SamplingParams(temperature=1.0, seed=2, max_tokens=30, min_tokens=12,
                       structured_outputs=StructuredOutputsParams(regex=r"[a-z]{1,80}")),
    ], use_tqdm=False)
    assert len(out[0].outputs) == 3
    for c in out[0].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(r"[a-z]{10,20}", c.text)
        assert len(c.logprobs) == len(c.token_ids)
    capped = out[1].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 4
    assert re.fullmatch(r"[a-z]+", capped.text)
    stopped = out[2].outputs[0]
    assert stopped.finish_reason == "stop" and "e" not in stopped.text
    assert stopped.stop_reason == "e" and re.fullmatch(r"[a-z]*", stopped.text)
    at_least = out[3].outputs[0]  # EOS is masked below min_tokens, as the grammar allows
    assert len(at_least.token_ids) >= 12 and re.fullmatch(r"[a-z]{1,80}", at_least.text)


@pytest.mark.parametrize("constraint, field", [
    (dict(regex="[a-z"), "structured_outputs.regex"),
    (dict(json={"type": "objectx"}), "structured_outputs.json"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(choice=["a"], regex="a"), "only use one kind"),
])
def test_bad_specs_are_value_errors_naming_the_field(llm, constraint, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2),
                                  SamplingParams(max_tokens=2, structured_outputs=constraint)],
                     use_tqdm=False)
    assert not llm.llm_engine.engine_core.has_unfinished_requests()


def test_grammar_failing_while_serving_fails_that_request_alone(llm):
    manager = llm.llm_engine.engine_core.scheduler.structured_output_manager
    compile_ = manager._compile

    def compile_or_fail(params):
        if params.regex == "failing":
            raise ValueError("structured_outputs.regex is invalid: injected")
        return compile_(params)

    manager._compile = compile_or_fail
    try:
        out = llm.generate(["a", "b", "c"], [
            SamplingParams(temperature=0.0, max_tokens=5, structured_outputs={"regex": "x+"}),
            SamplingParams(temperature=0.0, max_tokens=5, structured_outputs={"regex": "failing"}),
            SamplingParams(temperature=0.0, max_tokens=5)], use_tqdm=False)
    finally:
        manager._compile = compile_
    assert [o.outputs[0].finish_reason for o in out] == ["length", "error", "length"]
    assert out[0].outputs[0].text == "xxxxx"
    assert llm.llm_engine.kv_cache_manager.usage == 0.0


def test_preemption_keeps_constrained_outputs(tiny_llm, make_tiny_llm):
    tight = make_tiny_llm(max_model_len=128, num_gpu_blocks_override=1 + 12)
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (30, 45, 22, 60)]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=64, structured_outputs=c)
              for i, (t, c) in enumerate([
                  # Digits are one token each: these outputs reach max_tokens.
                  (0.0, StructuredOutputsParams(regex=r"([0-9]{2},){40}")),
                  (1.0, StructuredOutputsParams(regex=r"([0-9]{2},){40}")),
                  (0.0, StructuredOutputsParams(json_object=True)),
                  (1.0, StructuredOutputsParams(regex=r"([0-9] ){60}"))])]
    roomy = tiny_llm.generate(prompts, params, use_tqdm=False)
    before = tight.llm_engine.engine_core.scheduler.num_preemptions
    out = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > before
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in roomy]
    for o, p in zip(out, params):  # cut by max_tokens: a prefix of a match
        assert o.outputs[0].finish_reason == "length"
        if p.structured_outputs.regex:
            assert re.fullmatch(r"[0-9, ]+", o.outputs[0].text)
    assert tight.llm_engine.kv_cache_manager.usage == 0.0
