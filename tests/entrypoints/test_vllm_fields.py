"""vLLM 0.32's request fields on /v1/completions and /v1/chat/completions, in process: the
regressions of issue 19's bugs, the fields honoured (each checked against what the engine
itself says: its tokens, its prompt logprobs, its cache), the 400s vLLM gives, and the
fields accepted without effect or refused (request_rules.py)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from jaxllm.entrypoints.openai.request_rules import NO_EFFECT, REFUSED

from inprocess_app import error_of

C, CH = "/v1/completions", "/v1/chat/completions"
VOCAB = 49152
# A request template (the server trusts them) that shows what reaches it.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% for d in documents or [] %}[doc {{ d['title'] }}: {{ d['text'] }}]"
    "{% endfor %}{% if reasoning_effort %}[effort {{ reasoning_effort }} "
    "{{ enable_thinking }}]{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ASK = [{"role": "user", "content": "Say something"}]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(inprocess_server):
    return inprocess_server  # conftest.py's, shared with the other in-process modules


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    server.assert_idle()


def ok(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# ---- the bugs of issue 19 ----------------------------------------------------------------

def test_logprobs_0_states_the_sampled_token_at_each_position(server):
    lp = ok(server.post(C, {"prompt": "Hello", "max_tokens": 3, "logprobs": 0,
                                   **GREEDY}))["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


def test_streamed_text_offsets_are_the_non_streamed_ones_when_text_is_held_back(
        server):
    # A stop string that never matches holds back 5 characters of text behind the tokens.
    body = {"prompt": "Hello", "max_tokens": 8, "logprobs": 1, "stop": ["\n\n\n\nqz"], **GREEDY}
    whole = ok(server.post(C, body))["choices"][0]["logprobs"]
    chunks = events(server.post(C, {**body, "stream": True}))
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]
    assert offsets == [sum(map(len, whole["tokens"][:i])) for i in range(len(tokens))]


def test_top_logprobs_minus_one_is_the_whole_vocabulary(server, monkeypatch):
    """With max_logprobs the vocabulary, -1 asks for all of it (it returned []). Checked
    at admission and in the formats, on one position holding the whole vocabulary: an
    engine whose sampler's width is the vocabulary costs 10 s of compiling here."""
    from jaxllm.entrypoints.openai.logprobs_format import chat_logprobs, completion_logprobs
    from jaxllm.outputs import Logprob
    from jaxllm.sampling_params import SamplingParams

    processor = server.engine.engine.processor
    monkeypatch.setattr(processor, "max_logprobs", VOCAB)
    assert processor.check_params(SamplingParams(logprobs=-1)).logprobs == -1
    monkeypatch.setattr(processor, "max_logprobs", 20)
    with pytest.raises(ValueError, match="Requested logprobs of 49152, which is greater "
                                         "than max allowed: 20"):
        processor.check_params(SamplingParams(logprobs=-1))
    chosen = 7
    entry = {chosen: Logprob(-3.0, 4, "t7")}
    entry.update({t: Logprob(-1.0 - t / VOCAB, t + 1, f"t{t}") for t in range(VOCAB)
                  if t != chosen})
    chat = chat_logprobs([chosen], [entry], -1)["content"][0]
    assert len(chat["top_logprobs"]) == VOCAB
    assert chat["top_logprobs"][0] == {"token": "t7", "logprob": -3.0, "bytes": list(b"t7")}
    legacy = completion_logprobs([chosen], [entry], -1, 0)
    assert len(legacy["top_logprobs"][0]) == VOCAB


@pytest.mark.parametrize("path, body, param, fragment", [
    (C, {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    (CH, {"messages": ASK, "stream": False, "stream_options": {"include_usage": True}},
     "stream_options", "Stream options can only be defined when `stream=True`."),
    (C, {"prompt": "Hi", "seed": 2**63}, "seed", "less than or equal to 9223372036854775807"),
    (CH, {"messages": ASK, "seed": -2**63 - 1}, "seed", "greater than or equal to"),
    (CH, {"messages": ASK, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "When using `tool_choice`, `tools` must be set."),
    (CH, {"messages": ASK, "tools": []}, "tools", "`tools` must not be an empty array"),
    (CH, {"messages": ASK, "top_logprobs": 2}, "top_logprobs",
     "when using `top_logprobs`, `logprobs` must be set to true."),
    (C, {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    (C, {"prompt": "Hi", "logprobs": -2}, "logprobs", "must be a positive value or -1"),
    (C, {"prompt": "Hi", "logprobs": "3"}, "logprobs", "`logprobs` must be an integer."),
    (CH, {"messages": ASK, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "Cannot set both"),
    (C, {"prompt": "Hi", "use_beam_search": True, "stream": True}, "use_beam_search",
     "Streaming is not currently supported with beam search"),
    (C, {"prompt": "Hi", "cache_salt": ""}, "cache_salt", "non-empty string"),
    (C, {"prompt": "Hi", "cache_salt": "a/b"}, "cache_salt", "must not contain"),
    (C, {"prompt": "Hi", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens",
     "truncate_prompt_tokens=65 cannot be greater than max_model_len = 64"),
    (C, {"prompt": "Hi", "truncation_side": "middle"}, "truncation_side", "left"),
    (C, {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias",
     "logit_bias contains key(s) that cannot be converted to integer token IDs: ['x']"),
    (CH, {"messages": ASK, "logit_bias": {str(VOCAB): 1}}, "logit_bias",
     f"[{VOCAB}] in logit_bias contain out-of-vocab token ids"),
    (CH, {"messages": ASK, "mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs",
     "no multimodal input"),
])
def test_vllms_400s_name_the_field(server, path, body, param, fragment):
    error = error_of(server.post(path, body), 400)
    assert error["param"] == param and fragment in error["message"], error


def test_custom_roles_reach_the_template(server):
    body = ok(server.post(CH, {"messages": [{"role": "wizard", "content": "Abra"}],
                               "max_tokens": 1, "return_prompt_text": True,
                               "chat_template": TEMPLATE}))
    assert body["prompt_text"] == "<|im_start|>wizard\nAbra<|im_end|>\n<|im_start|>assistant\n"
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_a_client_that_leaves_logs_no_traceback_and_leaks_nothing(server, caplog):
    """The ASGI app called as a server calls it, by a client that disconnects while its
    request runs: the handler is cancelled and answers 499, which nobody reads. It used to
    be wrapped in a StreamingResponse ("'Response' object is not iterable")."""
    body = json.dumps({"prompt": "Go on", "max_tokens": 48, **GREEDY}).encode()
    sent = []

    async def call():
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if pending:
                return pending.pop()
            engine = server.engine.engine
            while not engine.has_unfinished_requests():  # the client leaves while its
                await asyncio.sleep(0.001)               # request runs (48 steps)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": C, "raw_path": C.encode(),
                 "query_string": b"", "root_path": "", "client": ("client", 1),
                 "server": ("jaxllm", 80), "headers": [(b"content-type", b"application/json")]}
        await server.app(scope, receive, send)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(call())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    server.assert_idle()  # aborted: every KV block back


# ---- fields honoured ---------------------------------------------------------------------

def test_echo_returns_the_prompt_with_its_logprobs(server):
    prompt = "The capital of France is"
    body = {"prompt": prompt, "max_tokens": 3, "logprobs": 1, "echo": True,
            "return_token_ids": True, **GREEDY}
    choice = ok(server.post(C, body))["choices"][0]
    plain = ok(server.post(C, {**body, "echo": False}))["choices"][0]
    n = len(choice["prompt_token_ids"])
    # return_token_ids with echo: vLLM echoes "" as the prompt's text
    assert choice["text"] == plain["text"]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    # the prompt's logprobs are the engine's prompt logprobs, entry by entry
    for i, entry in enumerate(choice["prompt_logprobs"][1:], start=1):
        chosen = entry[str(choice["prompt_token_ids"][i])]
        assert lp["token_logprobs"][i] == chosen["logprob"]
    text = ok(server.post(C, {**body, "return_token_ids": False}))["choices"][0]
    assert text["text"] == prompt + plain["text"]
    assert "".join(text["logprobs"]["tokens"]) == text["text"]
    assert text["logprobs"]["text_offset"][n] == len(prompt)
    only = ok(server.post(C, {"prompt": prompt, "max_tokens": 0, "echo": True}))
    assert only["choices"][0]["text"] == prompt


def test_echo_streamed_is_the_whole_echo(server):
    body = {"prompt": "Tell me", "max_tokens": 4, "logprobs": 0, "echo": True, **GREEDY}
    whole = ok(server.post(C, body))["choices"][0]
    chunks = events(server.post(C, {**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == \
        whole["logprobs"]["text_offset"]


def test_logit_bias_decides_the_greedy_token(server):
    body = {"prompt": "Hello", "max_tokens": 3, "return_token_ids": True, **GREEDY}
    plain = ok(server.post(C, body))["choices"][0]["token_ids"]
    forced = ok(server.post(C, {**body, "logit_bias": {"42": 100}}))
    assert forced["choices"][0]["token_ids"] == [42, 42, 42]
    banned = ok(server.post(C, {**body, "logit_bias": {str(plain[0]): -100}}))
    assert banned["choices"][0]["token_ids"][0] != plain[0]
    # the next request in the same slot is not biased any more
    assert ok(server.post(C, body))["choices"][0]["token_ids"] == plain


def test_prompt_logprobs_on_both_endpoints(server):
    out = ok(server.post(C, {"prompt": "One two three", "max_tokens": 1,
                                    "prompt_logprobs": 2, "return_token_ids": True}))
    choice = out["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(choice["prompt_token_ids"])
    for token_id, entry in zip(choice["prompt_token_ids"][1:], entries[1:]):
        # the prompt's token, then the top 2 (vLLM's prompt_logprobs=2)
        assert str(token_id) in entry and len(entry) in (2, 3)
        assert {1, 2} <= {e["rank"] for e in entry.values()}
    chat = ok(server.post(CH, {"messages": ASK, "max_tokens": 1, "prompt_logprobs": 0,
                                      "return_token_ids": True}))
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(server):
    prompt = "one two three four five six seven"
    full = ok(server.post(C, {"prompt": prompt, "max_tokens": 1,
                                     "return_token_ids": True}))["choices"][0]
    ids = full["prompt_token_ids"]
    for side, kept in (("left", ids[-3:]), ("right", ids[:3]), (None, ids[-3:])):
        body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 3,
                "return_token_ids": True}
        if side:
            body["truncation_side"] = side
        out = ok(server.post(C, body))
        assert out["choices"][0]["prompt_token_ids"] == kept, side
        assert out["usage"]["prompt_tokens"] == 3
    chat = ok(server.post(CH, {"messages": ASK, "max_tokens": 1,
                                      "truncate_prompt_tokens": 4, "return_token_ids": True}))
    assert len(chat["prompt_token_ids"]) == 4


def test_cache_salt_separates_cached_prefixes(server):
    prompt = list(range(1000, 1040))  # two full blocks of 16
    body = {"prompt": prompt, "max_tokens": 1}

    def cached(extra):
        usage = ok(server.post(C, {**body, **extra}))["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    cached({})  # computed once, then cached
    assert cached({}) == 32
    assert cached({"cache_salt": "alice"}) == 0  # a salted request never reads others' KV
    assert cached({"cache_salt": "alice"}) == 32
    assert cached({"cache_salt": "bob"}) == 0


def test_continuous_usage_stats_count_each_chunk(server):
    for path, body in ((C, {"prompt": "Hi"}), (CH, {"messages": ASK})):
        chunks = events(server.post(path, {
            **body, "max_tokens": 4, "stream": True, **GREEDY,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
        final = chunks[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4
        counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
        assert counts == sorted(counts) and counts[-1] == 4, counts
        prompt = final["usage"]["prompt_tokens"]
        assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)


def test_template_fields_reach_the_template(server):
    body = ok(server.post(CH, {
        "messages": ASK, "max_tokens": 1, "return_prompt_text": True, "chat_template": TEMPLATE,
        "documents": [{"title": "T", "text": "body"}], "reasoning_effort": "low"}))
    assert "[doc T: body][effort low True]" in body["prompt_text"]


def test_beam_search_returns_the_best_beams_first(server):
    out = ok(server.post(C, {"prompt": "Hello", "max_tokens": 3, "n": 3,
                                    "use_beam_search": True, "temperature": 0,
                                    "return_token_ids": True, "ignore_eos": True}))
    beams = [c["token_ids"] for c in out["choices"]]
    assert len(beams) == len(set(map(tuple, beams))) == 3

    def score(tokens):  # the beams rescored by the engine's own prompt logprobs
        scored = ok(server.post(C, {"prompt": [19556, *tokens], "max_tokens": 1,
                                           "prompt_logprobs": 0}))["choices"][0]
        return sum(e[str(t)]["logprob"] for e, t in zip(scored["prompt_logprobs"][1:],
                                                        tokens)) / (1 + len(tokens))

    scores = [score(b) for b in beams]
    assert all(a >= b - 1e-5 for a, b in zip(scores, scores[1:])), scores
    chat = ok(server.post(CH, {"messages": ASK, "max_tokens": 2, "n": 2,
                                      "use_beam_search": True}))
    assert [c["index"] for c in chat["choices"]] == [0, 1]


def test_fields_without_effect_are_accepted_and_refused_ones_only_when_asked(server):
    values = {"user": "u", "session_id": "s", "routed_experts_prompt_start": 2,
              "return_token_offsets": True, "mm_payload": "none", "return_mm_kwargs": False,
              "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"b": 2},
              "include_reasoning": False, "parallel_tool_calls": False}
    assert set(values) == set(NO_EFFECT)
    ok(server.post(CH, {"messages": ASK, "max_tokens": 1, **values}))
    off = {"suffix": None, "watermarking": False, "logprob_token_ids": [],
           "repetition_detection": None, "thinking_token_budget": -1,
           "mm_processor_kwargs": {}, "media_io_kwargs": {}}
    on = {"suffix": "x", "watermarking": True, "logprob_token_ids": [5],
          "repetition_detection": {"max_pattern_size": 4}, "thinking_token_budget": 8,
          "mm_processor_kwargs": {"a": 1}, "media_io_kwargs": {"image": {}}}
    assert set(off) == set(on) == set(REFUSED)
    ok(server.post(CH, {"messages": ASK, "max_tokens": 1,
                               **{k: v for k, v in off.items() if k != "suffix"}}))
    for name, value in on.items():
        path, body = (C, {"prompt": "Hi"}) if name == "suffix" else (CH, {"messages": ASK})
        assert error_of(server.post(path, {**body, name: value}), 400)["param"] == name


def test_stream_interval_holds_deltas_until_they_hold_that_many_tokens(server):
    body = {"max_tokens": 8, "return_token_ids": True, **GREEDY}
    whole = ok(server.post(C, {**body, "prompt": "Hi"}))["choices"][0]["token_ids"]
    for path, extra in ((C, {"prompt": "Hi"}), (CH, {"messages": ASK})):
        chunks = events(server.post(path, {**body, **extra, "stream": True,
                                           "stream_interval": 3}))
        sizes = [len(c["choices"][0]["token_ids"]) for c in chunks
                 if c["choices"] and "token_ids" in c["choices"][0]]
        assert sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]) and sum(sizes) == 8, sizes
        if path == C:
            assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole
