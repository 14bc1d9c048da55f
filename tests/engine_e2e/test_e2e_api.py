"""The user-facing API on the tiny model: prompt forms, per-prompt params, n, stop rules,
logprobs, chat templates, metrics, abort. EOS behaviour (min_tokens, ignore_eos) needs a
model that emits EOS: it is in test_e2e_real_model.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.outputs import Logprob

from tiny_model import greedy, metric_values, token_ids

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4",
           "Once upon a time, in a small village by the sea, there lived"]


@pytest.fixture(scope="module")
def base(tiny_llm):
    """Greedy 24-token continuations of PROMPTS (ignore_eos)."""
    return tiny_llm.generate(PROMPTS, greedy(24), use_tqdm=False)


def test_prompt_forms_are_equivalent(tiny_llm, tokenizer, base):
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = token_ids(base)
    assert [o.prompt for o in base] == PROMPTS
    assert [o.prompt_token_ids for o in base] == ids

    single, = tiny_llm.generate(PROMPTS[1], greedy(24), use_tqdm=False)
    assert (single.prompt, token_ids([single])) == (PROMPTS[1], [expected[1]])

    one_dict, = tiny_llm.generate({"prompt_token_ids": ids[2]}, greedy(24), use_tqdm=False)
    assert one_dict.prompt is None and one_dict.prompt_token_ids == ids[2]
    assert token_ids([one_dict]) == [expected[2]]

    dicts = tiny_llm.generate([{"prompt_token_ids": i} for i in ids], greedy(24),
                              use_tqdm=False)
    assert token_ids(dicts) == expected

    old_style = tiny_llm.generate(prompts=None, sampling_params=greedy(24),
                                  prompt_token_ids=[ids[3], ids[0]], use_tqdm=False)
    assert token_ids(old_style) == [expected[3], expected[0]]
    assert [o.outputs[0].text for o in dicts] == [o.outputs[0].text for o in base]


def test_outputs_in_input_order_with_one_params_per_prompt(tiny_llm, base):
    # Longest output first, so requests finish in the reverse of input order.
    lengths = [9, 7, 3, 1]
    outputs = tiny_llm.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert token_ids(outputs) == [t[:n] for t, n in zip(token_ids(base), lengths)]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert all(o.outputs[0].stop_reason is None for o in outputs)


def test_n_completions(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True)
    out, = tiny_llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert params.seed is None  # the engine seeds its own copies, not the user's object
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.text for c in out.outputs}) == 3
    assert all(len(c.token_ids) == 8 for c in out.outputs)


def test_stop_string_cuts_the_text(tiny_llm, base):
    full, ids = base[3].outputs[0].text, base[3].outputs[0].token_ids
    start = next(k for k in range(len(full) // 2, len(full) - 3)
                 if full.find(full[k:k + 3]) == k and full[k:k + 3].strip())
    stop = full[start:start + 3]

    out = tiny_llm.generate(PROMPTS[3], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:start]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(ids) and list(out.token_ids) == ids[:len(out.token_ids)]

    kept = tiny_llm.generate(PROMPTS[3], greedy(24, stop=[stop], include_stop_str_in_output=True),
                             use_tqdm=False)[0].outputs[0]
    assert kept.text == full[:start + 3]
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)

    # The stop string completes on the last allowed token: the stop string wins over
    # "length" (as in vLLM, whose output processor checks stop strings last).
    last = tiny_llm.generate(PROMPTS[3], greedy(len(out.token_ids), stop=[stop]),
                             use_tqdm=False)[0].outputs[0]
    assert (last.text, last.finish_reason, last.stop_reason) == (full[:start], "stop", stop)


def test_stop_token_ids(tiny_llm, tokenizer, base):
    ids = base[0].outputs[0].token_ids
    k = next(k for k in range(3, len(ids)) if ids.index(ids[k]) == k)
    out = tiny_llm.generate(PROMPTS[0], greedy(24, stop_token_ids=[ids[k]]),
                            use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == ids[:k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[k])
    assert out.text == tokenizer.decode(ids[:k])  # the stop token is not shown


def test_min_tokens_masks_stop_token_ids(tiny_llm, base):
    """A stop token greedy would pick at step 2 is banned until 6 tokens exist."""
    ids = base[1].outputs[0].token_ids
    params = greedy(16, stop_token_ids=[ids[2]], min_tokens=6)
    out = tiny_llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids[:2]) == ids[:2]
    assert ids[2] not in out.token_ids[:6]
    assert len(out.token_ids) >= 6


def test_sample_logprobs(tiny_llm, tokenizer):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True,
                            logprobs=3)
    out = tiny_llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 12
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and all(isinstance(v, Logprob) for v in entry.values())
        top = sorted((v for t, v in entry.items() if t != token or v.rank <= 3),
                     key=lambda v: v.rank)
        assert [v.rank for v in top] == [1, 2, 3]
        assert [v.logprob for v in top] == sorted((v.logprob for v in top), reverse=True)
        assert len(entry) == (3 if entry[token].rank <= 3 else 4)
        assert entry[token].logprob <= top[0].logprob <= 0.0
        assert entry[token].decoded_token == tokenizer.decode([token])
    assert any(entry[t].rank > 1 for t, entry in zip(out.token_ids, out.logprobs))
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)), abs=1e-4)

    # 0 means: only the chosen (sampled / actual prompt) token.
    zero, = tiny_llm.generate(PROMPTS[2], greedy(3, logprobs=0, prompt_logprobs=0),
                              use_tqdm=False)
    assert [list(e) for e in zero.outputs[0].logprobs] == [[t] for t in zero.outputs[0].token_ids]
    assert all(e[t].rank == 1 for t, e in zip(zero.outputs[0].token_ids, zero.outputs[0].logprobs))
    assert [list(e) for e in zero.prompt_logprobs[1:]] == [[t] for t in zero.prompt_token_ids[1:]]


def test_prompt_logprobs_line_up_with_sample_logprobs(tiny_llm, tokenizer):
    """Prompt = Q + the 4 greedy tokens after Q: prompt logprob j scores prompt token j given
    tokens < j, so positions len(Q)..len(Q)+3 equal those tokens' sample logprobs (rank 1)."""
    q = tokenizer(PROMPTS[3])["input_ids"]
    first = tiny_llm.generate({"prompt_token_ids": q}, greedy(4, logprobs=1),
                              use_tqdm=False)[0].outputs[0]
    prompt = q + list(first.token_ids)
    out, = tiny_llm.generate({"prompt_token_ids": prompt}, greedy(2, prompt_logprobs=2),
                             use_tqdm=False)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for token, entry in zip(prompt[1:], out.prompt_logprobs[1:]):
        assert token in entry and len(entry) in (2, 3)
        assert {v.rank for t, v in entry.items() if t != token} <= {1, 2}
    got = [out.prompt_logprobs[len(q) + k][t] for k, t in enumerate(first.token_ids)]
    want = [first.logprobs[k][t] for k, t in enumerate(first.token_ids)]
    assert [g.rank for g in got] == [1, 1, 1, 1]
    np.testing.assert_allclose([g.logprob for g in got], [w.logprob for w in want], atol=1e-4)


def test_chat_renders_through_the_chat_template(tiny_llm, tokenizer):
    conversations = [[{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "What is 2 + 2?"}]]
    outputs = tiny_llm.chat(conversations, greedy(3), use_tqdm=False)
    for conv, out in zip(conversations, outputs):
        want = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
        assert out.prompt_token_ids == list(want)
        assert out.prompt == tokenizer.apply_chat_template(conv, add_generation_prompt=True,
                                                           tokenize=False)
    one, = tiny_llm.chat(conversations[0], greedy(3), use_tqdm=False)
    assert token_ids([one]) == token_ids(outputs[:1])


def test_get_tokenizer(tiny_llm, tokenizer):
    tok = tiny_llm.get_tokenizer()
    assert len(tok) == len(tokenizer) == tiny_llm.llm_engine.model_config.vocab_size
    assert tok("Hello world")["input_ids"] == tokenizer("Hello world")["input_ids"]
    assert tok.eos_token_id == tokenizer.eos_token_id


def test_metrics(tiny_llm, tokenizer):
    names = {m.name for m in tiny_llm.get_metrics()}
    assert {"jaxllm:prompt_tokens_total", "jaxllm:generation_tokens_total",
            "jaxllm:num_preemptions_total", "jaxllm:num_requests_running",
            "jaxllm:num_requests_waiting", "jaxllm:kv_cache_usage_perc"} <= names
    engine = tiny_llm.llm_engine
    before = metric_values(tiny_llm)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    for i, n in zip(ids, (3, 5, 7)):
        engine.add_request(None, i, greedy(n))
    now = metric_values(tiny_llm)
    assert (now["jaxllm:num_requests_waiting"], now["jaxllm:num_requests_running"]) == (3, 0)
    engine.step()
    now = metric_values(tiny_llm)
    assert (now["jaxllm:num_requests_waiting"], now["jaxllm:num_requests_running"]) == (0, 3)
    assert 0.0 < now["jaxllm:kv_cache_usage_perc"] <= 1.0
    while engine.has_unfinished_requests():
        engine.step()
    after = metric_values(tiny_llm)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["jaxllm:prompt_tokens_total"] == sum(len(i) for i in ids)
    assert delta["jaxllm:generation_tokens_total"] == 3 + 5 + 7
    assert delta["jaxllm:num_preemptions_total"] == 0
    assert (after["jaxllm:num_requests_waiting"], after["jaxllm:num_requests_running"]) == (0, 0)
    assert after["jaxllm:kv_cache_usage_perc"] == 0.0


def test_abort_frees_the_request(tiny_llm, tokenizer):
    engine = tiny_llm.llm_engine
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    aborted_before = aborted_count(tiny_llm)
    keep = engine.add_request(None, ids[0], greedy(6))
    drop = engine.add_request(None, ids[1], greedy(50))
    engine.step()
    engine.step()
    engine.abort_request(drop)
    assert drop not in engine.scheduler.requests  # blocks freed at once, not at the next step
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    # The aborted request ends with a final output of its own, first.
    assert [(o.request_id, o.outputs[0].finish_reason) for o in done] == [
        (drop, "abort"), (keep, "length")]
    assert 1 <= len(done[0].outputs[0].token_ids) < 50
    assert token_ids(done[1:]) == [token_ids(tiny_llm.generate({"prompt_token_ids": ids[0]},
                                                               greedy(6), use_tqdm=False))[0]]
    assert metric_values(tiny_llm)["jaxllm:kv_cache_usage_perc"] == 0.0
    assert aborted_count(tiny_llm) == aborted_before + 1


def aborted_count(llm) -> int:
    return next(m.value for m in llm.get_metrics() if m.name == "jaxllm:request_success_total"
                and m.labels["finished_reason"] == "abort")
